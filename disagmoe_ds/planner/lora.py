"""LoRA fine-tuning in the planner's vocabulary: which projections carry adapters, the parameters and activation
bytes those add, and which parameters keep a full training state (pure Python).

The semantics are the runtime's (the ds_config section ``"disagmoe": {"lora": {"rank", "targets", ...}}``): rank r
on a subset of three targets,

* ``attention``: every ``nn.Linear`` of a layer's token mixer. GQA: q, k, v, o (Qwen3-Next / Qwen3.5's q_proj also
  yields the output gate, 2 n d wide); MLA: q_a and q_b (or a direct q_proj), kv_a_proj_with_mqa, kv_b, o, and
  DeepSeek-V3.2's indexer (wq_b, wk, weights_proj); Gated DeltaNet: its in-projections (Qwen3-Next in_proj_qkvz
  and in_proj_ba, Qwen3.5 in_proj_qkv, _z, _b, _a) and out_proj. The conv is not a Linear.
* ``mlp``: gate, up and down of the dense MLP layers and of the shared experts (Qwen2's shared-expert gate, a
  Linear(H -> 1) beside them, is not one of those three).
* ``experts``: each routed expert's fused gate_up_proj [2I x H] and down_proj [H x I].

A Linear(in -> out) gets A [r x in] and B [out x r]: r (in + out) parameters. Its backward needs the r-wide output of
A per token (bf16: 2r bytes), which is new; its input is the tensor the base GEMM saves already (LoRA dropout 0).
Every base weight is frozen (embedding, head, norms, and the router unless ``train_router``): it keeps its parameter
bytes only. The adapters (and a trained router) keep the full state (``training_state.Precision.per_param``): they
are what DeepSpeed's optimizer gets.

Compute (``GemmFlops``, priced by ``part_times.py``): a frozen weight's GEMM needs no weight gradient, so its backward
is the input gradient alone (1x its forward, not 2x); each adapter adds 2r (in + out) FLOPs per token to the forward,
as much again to the input gradient and as much to its own weight gradients.

>>> from disagmoe_ds.planner.model import ModelSpec
>>> spec = ModelSpec.from_config({"model_type": "mixtral", "hidden_size": 8, "num_hidden_layers": 1,
...     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16, "intermediate_size": 4,
...     "num_local_experts": 4, "num_experts_per_tok": 2})
>>> lora = LoRA(rank=2)
>>> mixer_projections(spec, 0), a_side_adapter_params(spec, 0, lora), expert_adapter_params(spec, lora)
(((8, 8), (8, 4), (8, 4), (8, 8)), 112, 56)
>>> a_side_split(spec, 0, lora)  # the A side of the layer: attention, norms, router frozen; the adapters trained
Params(frozen=240, trained=112, fp8=0)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.planner.hf_config import AttentionSpec, LinearAttentionSpec
from disagmoe_ds.planner.model import ACT_BYTES, ModelSpec

TARGETS = ("attention", "mlp", "experts")
DEFAULT_TARGETS = ("attention", "experts")  # the runtime's (models.lora; tests/test_lora.py ties them)
Projection = tuple[int, int]  # (in_features, out_features) of one Linear


@dataclass(frozen=True)
class LoRA:
    """Rank ``rank`` adapters on ``targets`` (rank 0: full fine-tuning, every weight trained); ``train_router``
    also trains each MoE layer's router in full; ``fp8_base``: the frozen projections stay as a checkpoint shipped in
    FP8 blocks holds them (DeepSeek-V3's layout, ``disagmoe_ds.fp8.frozen``). Targets are kept in ``TARGETS`` order,
    so equal runs compare equal."""

    rank: int = 0
    targets: tuple[str, ...] = TARGETS
    train_router: bool = False
    fp8_base: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"LoRA rank must be a non-negative integer (0: full fine-tuning), got {self.rank!r}")
        if isinstance(self.targets, str) or not isinstance(self.targets, Iterable):
            raise ConfigError(f"LoRA targets must be a list of names from {', '.join(TARGETS)}, got {self.targets!r}")
        unknown = sorted({str(t) for t in self.targets} - set(TARGETS))
        if unknown:
            raise ConfigError(f"unknown LoRA target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
        if self.rank and not self.targets:
            raise ConfigError(
                f"LoRA rank {self.rank} with no targets trains nothing; name some of {', '.join(TARGETS)}"
            )
        if not isinstance(self.train_router, bool):
            raise ConfigError(f"LoRA train_router must be true or false, got {self.train_router!r}")
        if self.train_router and not self.rank:
            raise ConfigError("LoRA train_router needs a LoRA rank above 0 (full fine-tuning trains the router anyway)")
        if self.fp8_base and not self.rank:
            raise ConfigError("an FP8 base needs a LoRA rank above 0 (full fine-tuning trains high-precision weights)")
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in self.targets))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def adapts(self, target: str) -> bool:
        return self.enabled and target in self.targets

    def describe(self) -> str:
        if not self.enabled:
            return "full fine-tuning"
        router = " + router" if self.train_router else ""
        base = " over an FP8 base" if self.fp8_base else ""
        return f"LoRA r={self.rank} on {', '.join(self.targets)}{router}{base}"


FULL = LoRA()  # full fine-tuning


@dataclass(frozen=True)
class Params:
    """Parameters by what training keeps for them: ``frozen`` ones their bytes only, ``trained`` ones parameter,
    gradient and optimizer state; ``fp8`` of the frozen ones are held in FP8 blocks (an FP8 base)."""

    frozen: float = 0
    trained: float = 0
    fp8: float = 0

    @property
    def total(self) -> float:
        return self.frozen + self.trained

    def __add__(self, other: Params) -> Params:
        return Params(self.frozen + other.frozen, self.trained + other.trained, self.fp8 + other.fp8)

    def scaled(self, factor: float) -> Params:
        return Params(self.frozen * factor, self.trained * factor, self.fp8 * factor)

    @staticmethod
    def most(parts: Iterable[Params]) -> Params:
        """The most of each kind any of ``parts`` holds (an upper bound on each)."""
        parts = list(parts)
        return Params(max(p.frozen for p in parts), max(p.trained for p in parts), max(p.fp8 for p in parts))


# ----- the Linears of each target -----
def mixer_projections(spec: ModelSpec, layer: int) -> tuple[Projection, ...]:
    """Every Linear of ``layer``'s token mixer (the ``attention`` target)."""
    h, a = spec.hidden_size, spec.attention
    if spec.is_linear(layer):
        assert spec.linear_attention is not None
        return _delta_net_projections(spec.linear_attention, h)
    if a.kind == "mla":
        return _mla_projections(a, h)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return ((h, 2 * q if a.output_gate else q), (h, kv), (h, kv), (q, h))


def _mla_projections(a: AttentionSpec, h: int) -> tuple[Projection, ...]:
    q_heads = a.num_heads * a.head_dim
    q = ((h, a.q_lora_rank), (a.q_lora_rank, q_heads)) if a.q_lora_rank else ((h, q_heads),)
    kv_up = a.num_heads * (a.head_dim - a.qk_rope_head_dim + a.v_head_dim)
    kv = ((h, a.kv_lora_rank + a.qk_rope_head_dim), (a.kv_lora_rank, kv_up))
    n, d = a.indexer_heads, a.indexer_head_dim  # DeepSeek-V3.2's indexer sits inside the attention module
    indexer = ((a.q_lora_rank, n * d), (h, d), (h, n)) if n else ()
    return q + kv + ((a.num_heads * a.v_head_dim, h),) + indexer


def _delta_net_projections(la: LinearAttentionSpec, h: int) -> tuple[Projection, ...]:
    qkv = 2 * la.key_dim + la.value_dim
    ins: tuple[Projection, ...]
    if la.split_in_proj:
        ins = ((h, qkv), (h, la.value_dim), (h, la.num_v_heads), (h, la.num_v_heads))
    else:
        ins = ((h, qkv + la.value_dim), (h, 2 * la.num_v_heads))
    return ins + ((la.value_dim, h),)


def mlp_projections(spec: ModelSpec, layer: int) -> tuple[Projection, ...]:
    """gate, up and down of ``layer``'s dense MLP or shared experts (the ``mlp`` target); none without either."""
    h = spec.hidden_size
    width = spec.shared_intermediate if spec.moe_layers[layer] else spec.dense_intermediate
    return ((h, width), (h, width), (width, h)) if width else ()


def expert_projections(spec: ModelSpec) -> tuple[Projection, ...]:
    """One routed expert's gate_up_proj and down_proj (the ``experts`` target)."""
    h, i = spec.hidden_size, spec.expert_intermediate
    return ((h, 2 * i), (i, h))


def a_side_projections(spec: ModelSpec, layer: int, lora: LoRA) -> tuple[Projection, ...]:
    """The Linears of ``layer``'s A part that carry adapters."""
    mixer = mixer_projections(spec, layer) if lora.adapts("attention") else ()
    return mixer + (mlp_projections(spec, layer) if lora.adapts("mlp") else ())


def _adapter_params(projections: Iterable[Projection], rank: int) -> int:
    return sum(rank * (i + o) for i, o in projections)


# ----- parameters -----
def a_side_adapter_params(spec: ModelSpec, layer: int, lora: LoRA) -> int:
    return _adapter_params(a_side_projections(spec, layer, lora), lora.rank)


def expert_adapter_params(spec: ModelSpec, lora: LoRA) -> int:
    """Adapter parameters of one routed expert: r (H + 2I) + r (I + H)."""
    return _adapter_params(expert_projections(spec), lora.rank) if lora.adapts("experts") else 0


def adapter_params(spec: ModelSpec, lora: LoRA) -> int:
    """Adapter parameters of the whole model."""
    experts = spec.num_moe_layers * spec.num_experts * expert_adapter_params(spec, lora)
    return sum(a_side_adapter_params(spec, i, lora) for i in range(spec.num_layers)) + experts


def a_side_split(spec: ModelSpec, layer: int, lora: LoRA) -> Params:
    """``layer``'s A part: its base weights (trained in full fine-tuning) and, with LoRA, its adapters."""
    base = spec.a_side_params(layer)
    if not lora.enabled:
        return Params(trained=base)
    router = spec.router_params() if lora.train_router and spec.moe_layers[layer] else 0
    fp8 = _weights(mixer_projections(spec, layer) + mlp_projections(spec, layer)) if lora.fp8_base else 0
    return Params(frozen=base - router, trained=router + a_side_adapter_params(spec, layer, lora), fp8=fp8)


def expert_split(spec: ModelSpec, lora: LoRA) -> Params:
    """One routed expert, with its adapters."""
    base = spec.expert_params()
    if not lora.enabled:
        return Params(trained=base)
    fp8 = _weights(expert_projections(spec)) if lora.fp8_base else 0
    return Params(frozen=base, trained=expert_adapter_params(spec, lora), fp8=fp8)


def _weights(projections: Iterable[Projection]) -> int:
    """The weight matrices' parameters (what a checkpoint in FP8 blocks quantizes: no norm, bias or router)."""
    return sum(i * o for i, o in projections)


def base_split(params: float, lora: LoRA) -> Params:
    """Base weights no adapter touches (embedding, final norm, LM head): frozen under LoRA."""
    return Params(frozen=params) if lora.enabled else Params(trained=params)


def ships_fp8_blocks(config: dict) -> bool:
    """Whether a config.json dict describes a checkpoint in FP8 blocks (whose base LoRA keeps in FP8)."""
    quantization = config.get("quantization_config") or {}
    return quantization.get("quant_method") == "fp8" and quantization.get("weight_block_size") is not None


def check_adapts(spec: ModelSpec, lora: LoRA) -> None:
    """Refuse a LoRA run whose targets hold no Linear of this model (nothing would train)."""
    if lora.enabled and not lora.train_router and adapter_params(spec, lora) == 0:
        raise ConfigError(
            f"LoRA targets {', '.join(lora.targets)} hold no projection of {spec.name} (it has no dense or shared "
            f"MLP), so nothing would train; add attention or experts"
        )


# ----- compute -----
@dataclass(frozen=True)
class GemmFlops:
    """FLOPs of a part's weight GEMMs per token (experts: per assignment) in one step: the forward, the backward's
    input-gradient (dgrad) GEMMs and its weight-gradient (wgrad) GEMMs. A trained weight costs its forward in each
    of the three; a frozen one (every base weight under LoRA) none in wgrad."""

    fwd: float
    dgrad: float
    wgrad: float

    @property
    def bwd(self) -> float:
        return self.dgrad + self.wgrad


def _gemm_flops(base: float, trained: float, adapters: float) -> GemmFlops:
    """``base`` forward FLOPs of which ``trained`` keep their wgrad, plus ``adapters``' forward FLOPs (each of
    an adapter's dgrad and wgrad costs its forward: dy B and dh A; B's and A's weight gradients)."""
    return GemmFlops(fwd=base + adapters, dgrad=base + adapters, wgrad=trained + adapters)


def adapter_flops(projections: Iterable[Projection], rank: int) -> int:
    """Forward FLOPs per token of the adapters on ``projections``: x A^T then h B^T, 2r (in + out) each."""
    return 2 * _adapter_params(projections, rank)


def a_side_gemm_flops(spec: ModelSpec, layer: int, lora: LoRA) -> GemmFlops:
    """``layer``'s A-part GEMMs (projections, router, shared or dense MLP; the attention core has no weights)."""
    base = spec.a_side_linear_flops(layer)
    if not lora.enabled:
        return _gemm_flops(base, base, 0)
    router = spec.router_flops() if lora.train_router and spec.moe_layers[layer] else 0
    return _gemm_flops(base, router, adapter_flops(a_side_projections(spec, layer, lora), lora.rank))


def expert_gemm_flops(spec: ModelSpec, lora: LoRA) -> GemmFlops:
    """One (token, expert) assignment: gate_up and down (6 H I), their adapters r (2H + 3I) x 2 with ``experts``."""
    base = 6 * spec.hidden_size * spec.expert_intermediate
    if not lora.enabled:
        return _gemm_flops(base, base, 0)
    adapters = adapter_flops(expert_projections(spec), lora.rank) if lora.adapts("experts") else 0
    return _gemm_flops(base, 0, adapters)


def head_gemm_flops(spec: ModelSpec, lora: LoRA) -> GemmFlops:
    """The LM head per token: frozen under LoRA (no target adapts it), its input gradient still needed."""
    base = spec.head_flops()
    return _gemm_flops(base, 0 if lora.enabled else base, 0)


# ----- activations -----
def a_side_adapter_bytes(spec: ModelSpec, layer: int, lora: LoRA) -> int:
    """Per token of ``layer``'s A part: the r-wide A output of each adapted Linear, kept for B's backward."""
    return ACT_BYTES * lora.rank * len(a_side_projections(spec, layer, lora))


def expert_adapter_bytes(spec: ModelSpec, lora: LoRA) -> int:
    """Per (token, expert) assignment: the r-wide A outputs of the expert's two adapted projections."""
    return ACT_BYTES * lora.rank * len(expert_projections(spec)) if lora.adapts("experts") else 0
