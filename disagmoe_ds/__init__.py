"""DisagMoE-DS: disaggregated attention/expert training of Mixture-of-Experts LLMs on DeepSpeed."""

import os

__version__ = "0.1.0"

# torch's default GPU probe (``torch.cuda.is_available()``, which DeepSpeed's import calls) initialises the CUDA
# driver, after which a forked child cannot use CUDA: the ranks that ``launch.local.spawn_local`` forks on a GPU
# machine (run_pretrain.py or disagmoe-verify without a launcher) would all fail. The NVML probe leaves it alone.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def _quiet_deepspeed_without_gpus() -> None:
    """DeepSpeed warns on every import that finds no GPU ("Setting accelerator to CPU. If you have GPU ..."), which
    a user of a CPU machine cannot act on: where torch sees no CUDA device, name the accelerator DeepSpeed would pick
    (our ranks run on CUDA or on CPUs, nothing else). An explicit ``DS_ACCELERATOR`` is left as it is."""

    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


_quiet_deepspeed_without_gpus()
