"""How this process takes part in the job: its rank and device, the backend of a local job, per-step seeds."""

from __future__ import annotations

import os

import torch

from disagmoe_ds.errors import ConfigError

# (rank, world size) variables of the launchers we know, in the order they are tried: torchrun and
# deepspeed's local launcher, then the MPI-family runners (deepspeed --launcher openmpi/mpich/mvapich, srun).
_RANK_VARS = (
    ("RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)


def launched_rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size a launcher gave it, before torch.distributed is initialised."""
    for rank_var, size_var in _RANK_VARS:
        if size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise ConfigError(f"no launcher environment: none of {[size for _, size in _RANK_VARS]} is set")


def local_backend(world_size: int) -> str:
    """Backend for ranks started here without a launcher: NCCL with one GPU per rank, gloo on a CPU-only machine.

    The GPU probe goes through NVML (the package's ``__init__`` says so) so that the parent does not initialise CUDA
    before forking its ranks.
    """
    if not torch.cuda.is_available():
        return "gloo"
    gpus = torch.cuda.device_count()
    if gpus < world_size:
        have = f"{gpus} GPU" + ("s" if gpus > 1 else "")
        raise ConfigError(
            f"the layout needs {world_size} ranks but this machine has {have}; shrink the layout, launch on more "
            f"hosts with deepspeed --hostfile, or train co-located (--mode colocated runs on any number of GPUs)"
        )
    return "nccl"


def rank_device() -> torch.device:
    """The accelerator bound to LOCAL_RANK, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def share_cores() -> None:
    """CPU ranks of one host split its cores (DeepSpeed's launcher leaves OMP_NUM_THREADS unset); an explicit
    OMP_NUM_THREADS wins. Oversubscribed intra-op pools slow every rank down."""
    local_size = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))


def seed_step(seed: int, step: int, rank: int) -> None:
    """Reseed every RNG from (seed, step, rank) before each step, so a resumed run draws exactly the random
    numbers (dropout, router jitter) of an uninterrupted one without saving RNG states."""
    torch.manual_seed((seed * 1_000_003 + step) * 4099 + rank)
