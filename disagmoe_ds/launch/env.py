"""Joining a job that an external launcher (torchrun, deepspeed, mpirun) started."""

from __future__ import annotations

import os
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from disagmoe_ds.errors import ConfigError

# Set by torchrun and by DeepSpeed's local launcher (deepspeed.launcher.launch) for every rank.
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# MPI-family runners (DeepSpeed's openmpi/mpich/impi/mvapich runners, srun with PMI) set these instead;
# deepspeed.init_distributed then discovers the ranks through mpi4py.
_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def detect_launcher(environ: dict[str, str] | None = None) -> str | None:
    """Name the launcher that started this process, or None when it was started by hand.

    Returns "torchrun", "deepspeed", "env" (RANK/WORLD_SIZE/LOCAL_RANK set by something else, e.g.
    ``spawn_local``), "mpi", or None. A caller that gets None starts its own ranks (``spawn_local``).

    >>> detect_launcher({})
    >>> detect_launcher({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"})
    'torchrun'
    """
    env = os.environ if environ is None else environ
    present = [name for name in _RANK_VARS if name in env]
    if present and len(present) < len(_RANK_VARS):
        missing = [name for name in _RANK_VARS if name not in env]
        raise ConfigError(
            f"partial launcher environment: {present} set but {missing} missing; set all of {list(_RANK_VARS)} "
            f"or none (then the job starts its own ranks)"
        )
    if present:
        if "TORCHELASTIC_RUN_ID" in env:
            return "torchrun"
        # deepspeed.launcher.launch exports the node rank as CROSS_RANK.
        return "deepspeed" if "CROSS_RANK" in env else "env"
    if any(name in env for name in _MPI_VARS):
        return "mpi"
    return None


def disable_shm_op() -> None:
    """Keep init_distributed from JIT-compiling deepspeed_shm_comm (35-120 s on CPU; only inference uses it)."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def preload_engine_imports() -> None:
    """Import once what every DeepSpeed engine imports on its first build: its optimizer check
    (``deepspeed.runtime.zero.utils.is_zero_supported_optimizer``) imports DeepSpeed's Muon optimizer, whose kernels'
    ``torch.compile`` wrappers import torch._inductor (about 1.6 s of CPU). Called in the parent of forked ranks,
    which then inherit it instead of each importing it again; it starts no thread or process."""
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:  # a DeepSpeed without it: its optimizer check skips it too
        pass


def init_from_env(backend: str | None = None, *, comm_timeout_s: float | None = None) -> None:
    """Initialise torch.distributed through DeepSpeed from the launcher's environment and bind the device.

    Args:
        backend: "gloo", "nccl", ...; None lets DeepSpeed pick the accelerator's backend (gloo on CPU).
        comm_timeout_s: every collective and point-to-point wait on every group fails after this long, so a
            rank whose peer died ends with an error instead of hanging; None keeps DeepSpeed's default.
    """
    disable_shm_op()
    # Set before CUDA initialises (binding the device below), so they take effect; values the user set win.
    # Each exchange communicator brings its own NCCL stream. With more streams than the GPU's hardware queues (8
    # by default), work of one stream can wait behind a blocked kernel of another that shares its queue (a
    # false dependency); under rendezvous that can close a wait cycle. 32 is CUDA's maximum.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    # Receives posted ahead are NCCL kernels that spin until their peer sends. Loading a kernel lazily (torch's
    # default) can synchronise the whole context, so a rank's first launch of a new kernel would wait for a spinning
    # receive whose sender waits for this rank: on NCCL's network transport, the first AF-Pipe step hung exactly
    # there (both ranks' hosts inside a first-time kernel). Eager loading has no such wait.
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    kwargs = {} if comm_timeout_s is None else {"timeout": timedelta(seconds=comm_timeout_s)}
    deepspeed.init_distributed(dist_backend=backend, verbose=False, **kwargs)
    # gloo ranks may outnumber the devices (CPU tests); device backends need one device per local rank, set
    # before the first collective so NCCL builds its communicators on the right GPU.
    if dist.get_backend() != "gloo":
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))


def process_device() -> torch.device:
    """Where this rank's tensors live: its GPU when the default group is NCCL, else the CPU (gloo)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
