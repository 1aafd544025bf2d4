"""DisagMoE-DS: disaggregated attention/expert training of Mixture-of-Experts LLMs on DeepSpeed."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

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


class _BeforeDeepSpeed(MetaPathFinder):
    """Runs ``_quiet_deepspeed_without_gpus`` just before the process first imports deepspeed, wherever that import
    is (engine, colocated, train, launch, a test): asking torch at package import would load torch into the pure
    Python planner (``disagmoe-plan``), and DeepSpeed reads ``DS_ACCELERATOR`` once, at its own import. Finds
    nothing itself: the import goes on through the finders after it. It stays in ``sys.meta_path`` (removing it
    while importlib loops over that list would skip the next finder); once deepspeed is imported it is not asked
    for it again, and asking twice is harmless."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == "deepspeed":
            _quiet_deepspeed_without_gpus()
        return None


if not any(isinstance(f, _BeforeDeepSpeed) for f in sys.meta_path):  # once, however often the package is reloaded
    sys.meta_path.insert(0, _BeforeDeepSpeed())
