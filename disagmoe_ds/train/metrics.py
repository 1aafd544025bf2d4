"""Throughput in model FLOPs, counted the Megatron way, and one record per step.

Model FLOPs per token come from ``disagmoe_ds.planner.model`` (Megatron-LM's counting: 2 FLOPs per
multiply-add, backward = 2x forward, only the top-k routed experts a token uses, causal attention over half
the score matrix; no recompute). TFLOP/s per GPU divides a step's model FLOPs by its wall time and by every
rank of the job, attention and FFN alike, so a layout that idles one side shows it. MFU is that over the
device's peak dense bf16 rate (PaLM, appendix B), unknown on CPU unless ``--peak-tflops`` gives one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from disagmoe_ds.planner.model import ModelSpec, load_model_spec
from disagmoe_ds.runtime.step import StepResult

# Dense bf16 peak TFLOP/s (no sparsity) by a substring of torch.cuda.get_device_name(); vendor datasheets.
PEAK_BF16_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "A100": 312.0,
    "A800": 312.0,
    "B200": 2250.0,
    "L40S": 362.0,
}


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of the model for the banner and the FLOP count of one step."""

    total_params: int
    active_params: int  # per token: every dense part plus top_k of the routed experts
    flops_per_token: float  # fwd + bwd model FLOPs at the run's sequence length
    moe_layers: tuple[bool, ...]


def model_facts(model_dir: Path, seq_len: int) -> ModelFacts:
    spec = load_model_spec(model_dir)
    return ModelFacts(spec.total_params(), _active_params(spec), spec.step_flops_per_token(seq_len), spec.moe_layers)


def _active_params(spec: ModelSpec) -> int:
    idle_experts = spec.num_experts - spec.top_k
    return spec.total_params() - spec.num_moe_layers * idle_experts * spec.expert_params()


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The device's dense bf16 peak, or None (CPU, unknown GPU): then no MFU is reported."""
    if override is not None or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as logged: a JSON line, a TensorBoard point, a progress-bar postfix."""

    step: int
    loss: float
    lm_loss: float
    aux_loss: float
    grad_norm: float | None
    lr: float
    step_s: float  # wall time of the whole iteration on rank 0 (data, pipeline, balancing, logging)
    tokens: int
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float | None
    expert_imbalance: list[float | None]  # per layer, max load / mean load; None for dense layers
    eval_loss: float | None = None  # after this step, on held-out data (``train.evaluation``); None: not evaluated
    peak_gib: float | None = None  # rank 0's peak GPU memory allocated so far, GiB; None on a CPU rank

    @property
    def max_imbalance(self) -> float | None:
        values = [v for v in self.expert_imbalance if v is not None]
        return max(values) if values else None

    def to_json(self) -> dict:
        """The JSON line: every field, ``eval_loss`` on the evaluation steps only."""
        record = {**asdict(self), "max_imbalance": self.max_imbalance}
        if self.eval_loss is None:
            del record["eval_loss"]
        return record


@dataclass(frozen=True)
class Throughput:
    """Turns a step's wall time into tokens/s, TFLOP/s per GPU and MFU."""

    tokens_per_step: int
    flops_per_token: float
    world_size: int
    peak_tflops: float | None

    def record(
        self,
        step: int,
        result: StepResult,
        *,
        lr: float,
        seconds: float,
        imbalance: list[float | None],
        eval_loss: float | None = None,
    ) -> StepRecord:
        tflops = self.tokens_per_step * self.flops_per_token / seconds / self.world_size / 1e12
        return StepRecord(
            step=step,
            loss=result.loss,
            lm_loss=result.lm_loss,
            aux_loss=result.aux_loss,
            grad_norm=result.grad_norm,
            lr=lr,
            step_s=seconds,
            tokens=self.tokens_per_step,
            tokens_per_s=self.tokens_per_step / seconds,
            tflops_per_gpu=tflops,
            mfu=tflops / self.peak_tflops if self.peak_tflops else None,
            expert_imbalance=imbalance,
            eval_loss=eval_loss,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        )
