"""Per-layer FLOP, byte, parameter and activation model of a Hugging Face MoE config.json (pure Python).

The config is read as a JSON dict; transformers is not imported. Supported ``model_type``s: qwen2_moe,
qwen3_moe, mixtral, olmoe, deepseek_v2, deepseek_v3, gpt_oss (field names differ per family, see
``hf-notes.md`` section 1; ``ModelSpec.from_config`` maps them onto one vocabulary).

Counting conventions (Megatron-LM ``num_floating_point_operations``; Narayanan et al. 2021, appendix):

* a [m, k] x [k, n] matmul costs 2mkn FLOPs; elementwise work (norms, softmax, RoPE, activations) is not counted;
* backward costs 2x forward (dgrad + wgrad), so a training step costs 3x forward (4x with full recompute);
* causal attention core: a sequence of s tokens has s^2/2 query-key pairs (the diagonal's s/2 is dropped,
  Megatron's "only half of the attention matrix is non-zero"); a sliding window w keeps s*w - w^2/2 pairs
  when s > w. A pair costs 2*d_qk FLOPs per head for the scores and 2*d_v for the weighted sum of values.

The split follows the runtime (DESIGN.md section 3): the A side holds norms, attention, router, shared
experts, dense MLP layers, embedding and LM head; the F side holds the routed experts only.

>>> spec = ModelSpec.from_config({"model_type": "mixtral", "hidden_size": 8, "num_hidden_layers": 2,
...     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16, "intermediate_size": 4,
...     "num_local_experts": 4, "num_experts_per_tok": 2})
>>> spec.routed_flops_per_token(), spec.attention_projection_flops()
(384, 384)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from disagmoe_ds.errors import ConfigError, UnsupportedModelError

SUPPORTED_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
ACT_BYTES = 2  # bf16 activations and wire format of hidden states
ID_BYTES = 4  # int32 expert ids on the wire (one per chosen expert)
WEIGHT_BYTES = 4  # fp32 routing weights on the wire (one per chosen expert)


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention shape. ``kind`` is "gqa" (MHA/GQA/MQA) or "mla" (DeepSeek multi-head latent attention)."""

    kind: Literal["gqa", "mla"]
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head size; for MLA the query/key head size qk_nope + qk_rope
    v_head_dim: int
    q_lora_rank: int = 0  # MLA only; 0 means a direct q_proj
    kv_lora_rank: int = 0  # MLA only
    qk_rope_head_dim: int = 0  # MLA only
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: Literal["", "head", "full"] = ""  # Qwen3: per-head RMSNorm; OLMoE: over the whole projection
    sinks: bool = False  # GPT-OSS learned attention sinks, one per head


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts of an MoE decoder the planner needs, family differences already resolved.

    ``moe_layers[i]`` is True where layer i has routed experts; ``windows[i]`` is its sliding window or 0.
    """

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    tie_word_embeddings: bool
    attention: AttentionSpec
    num_experts: int
    top_k: int
    expert_intermediate: int
    dense_intermediate: int
    shared_intermediate: int
    shared_gate: bool
    expert_bias: bool
    router_bias: bool
    moe_layers: tuple[bool, ...]
    windows: tuple[int, ...]

    # ----- construction -----
    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str = "") -> ModelSpec:
        """Build from a config.json dict; raises ``UnsupportedModelError`` / ``ConfigError`` with the field name."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by the planner; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        num_layers = _int(cfg, "num_hidden_layers")
        experts = _experts(cfg, model_type)
        return cls(
            name=name or model_type,
            model_type=model_type,
            hidden_size=_int(cfg, "hidden_size"),
            num_layers=num_layers,
            vocab_size=_int(cfg, "vocab_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention=_attention(cfg, model_type),
            moe_layers=_moe_layers(cfg, model_type, num_layers),
            windows=_windows(cfg, model_type, num_layers),
            **experts,
        )

    # ----- per-token forward FLOPs -----
    def attention_projection_flops(self) -> int:
        """Q, K, V and O projections per token (GQA) or the MLA down/up projections (Megatron MLA term)."""
        a, h = self.attention, self.hidden_size
        if a.kind == "gqa":
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            return 2 * h * q + 2 * 2 * h * kv + 2 * q * h
        q_heads = a.num_heads * a.head_dim
        q = 2 * (h * a.q_lora_rank + a.q_lora_rank * q_heads) if a.q_lora_rank else 2 * h * q_heads
        kv_down = 2 * h * (a.kv_lora_rank + a.qk_rope_head_dim)
        kv_up = 2 * a.kv_lora_rank * a.num_heads * (a.head_dim - a.qk_rope_head_dim + a.v_head_dim)
        return q + kv_down + kv_up + 2 * a.num_heads * a.v_head_dim * h

    def attention_core_flops(self, seq_len: int, layer: int) -> float:
        """Scores and weighted sum per token, averaged over a causal sequence of ``seq_len`` (module docstring)."""
        a = self.attention
        per_pair = 2 * a.num_heads * (a.head_dim + a.v_head_dim)
        return per_pair * causal_pairs(seq_len, self.windows[layer]) / seq_len

    def router_flops(self) -> int:
        return 2 * self.hidden_size * self.num_experts

    def shared_flops(self) -> int:
        """Shared experts (SwiGLU: gate, up, down) plus Qwen2's sigmoid shared-expert gate."""
        return 6 * self.hidden_size * self.shared_intermediate + (2 * self.hidden_size if self.shared_gate else 0)

    def dense_mlp_flops(self) -> int:
        return 6 * self.hidden_size * self.dense_intermediate

    def routed_flops_per_token(self) -> int:
        """top_k SwiGLU experts per token: 3 matmuls of H x I each."""
        return self.top_k * 6 * self.hidden_size * self.expert_intermediate

    def head_flops(self) -> int:
        return 2 * self.hidden_size * self.vocab_size

    def attention_side_flops(self, seq_len: int, layer: int) -> float:
        """A-side forward FLOPs per token of ``layer``: attention, then router + shared or the dense MLP."""
        attn = self.attention_projection_flops() + self.attention_core_flops(seq_len, layer)
        if self.moe_layers[layer]:
            return attn + self.router_flops() + self.shared_flops()
        return attn + self.dense_mlp_flops()

    def expert_side_flops(self, layer: int) -> int:
        """F-side forward FLOPs per token of ``layer`` (0 for a dense layer)."""
        return self.routed_flops_per_token() if self.moe_layers[layer] else 0

    def step_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of fwd + bwd per token over the whole model (3x forward; recompute not counted)."""
        fwd = sum(self.attention_side_flops(seq_len, i) + self.expert_side_flops(i) for i in range(self.num_layers))
        return 3 * (fwd + self.head_flops())

    # ----- parameters -----
    def attention_params(self) -> int:
        """One layer's self-attention parameters including the two layer norms around it."""
        a, h = self.attention, self.hidden_size
        norms = 2 * h
        if a.kind == "mla":
            return norms + _mla_params(a, h)
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        weights = h * q + 2 * h * kv + q * h
        bias = (q + 2 * kv if a.qkv_bias else 0) + (h if a.o_bias else 0)
        qk_norm = {"": 0, "head": 2 * a.head_dim, "full": q + kv}[a.qk_norm]
        return norms + weights + bias + qk_norm + (a.num_heads if a.sinks else 0)

    def a_side_params(self, layer: int) -> int:
        """A-side parameters of one layer: attention + norms + router + shared experts, or the dense MLP."""
        h = self.hidden_size
        if not self.moe_layers[layer]:
            return self.attention_params() + 3 * h * self.dense_intermediate
        router = self.num_experts * h + (self.num_experts if self.router_bias else 0)
        shared = 3 * h * self.shared_intermediate + (h if self.shared_gate else 0)
        return self.attention_params() + router + shared

    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up, down, plus GPT-OSS biases)."""
        h, i = self.hidden_size, self.expert_intermediate
        return 3 * h * i + (2 * i + h if self.expert_bias else 0)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """Final norm plus the LM head (nothing extra for the head when it is tied to the embedding)."""
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    def total_params(self) -> int:
        experts = sum(self.num_experts * self.expert_params() for i in range(self.num_layers) if self.moe_layers[i])
        dense = sum(self.a_side_params(i) for i in range(self.num_layers))
        return dense + experts + self.embedding_params() + self.head_params()

    # ----- activations (bytes kept for backward, per token, no recompute) -----
    def a_side_activation_bytes(self, layer: int) -> int:
        """Tensors autograd keeps for one token of one layer on the A side (bf16; flash-style attention).

        Layer input and the two norm outputs, Q/K/V, attention output and its log-sum-exp, the pre-norm
        residual, router logits and probabilities (fp32), and the SwiGLU intermediates of shared/dense MLPs.
        """
        a, h = self.attention, self.hidden_size
        if a.kind == "gqa":
            qkv = a.num_heads * a.head_dim + 2 * a.num_kv_heads * a.head_dim
        else:
            latent = a.q_lora_rank * 2 + (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
            qkv = latent + 2 * a.num_heads * a.head_dim + a.num_heads * a.v_head_dim
        attn = ACT_BYTES * (4 * h + qkv + a.num_heads * a.v_head_dim) + 4 * a.num_heads
        if not self.moe_layers[layer]:
            return attn + ACT_BYTES * 3 * self.dense_intermediate
        return attn + 2 * 4 * self.num_experts + ACT_BYTES * 3 * self.shared_intermediate

    def f_side_activation_bytes_per_assignment(self) -> int:
        """Per (token, chosen expert) on the F side: gathered input, gate/up output, activation, expert output."""
        return ACT_BYTES * (2 * self.hidden_size + 3 * self.expert_intermediate)

    def layer_input_bytes(self) -> int:
        """What full recompute keeps per token and layer: the layer input (Megatron full recompute)."""
        return ACT_BYTES * self.hidden_size

    # ----- bytes on the wire -----
    def distinct_ranks_per_token(self, ep_size: int) -> float:
        """Expected F ranks a token's top_k experts land on, uniform routing over ep_size ranks of E/ep experts.

        ep * (1 - C(E - E/ep, k) / C(E, k)): a token goes to a rank once however many of its experts live there.
        """
        if ep_size <= 1:
            return 1.0
        e, k, local = self.num_experts, self.top_k, self.num_experts // ep_size
        miss = math.comb(e - local, k) / math.comb(e, k) if e - local >= k else 0.0
        return ep_size * (1.0 - miss)

    def wire_bytes_per_token(self, ep_size: int) -> WireBytes:
        """Bytes per token and MoE layer on each AF-Pipe channel (DESIGN.md section 4)."""
        h, k = ACT_BYTES * self.hidden_size, self.top_k
        ranks = self.distinct_ranks_per_token(ep_size)
        return WireBytes(
            m2n=ranks * (h + k * (ID_BYTES + WEIGHT_BYTES)),
            n2m=ranks * h,
            n2m_grad=ranks * h,
            m2n_grad=ranks * (h + k * WEIGHT_BYTES),
            resid=h + k * ID_BYTES,
            resid_grad=h,
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)


@dataclass(frozen=True)
class WireBytes:
    """Bytes per token of one MoE layer: m2n A_g -> F_g, n2m F_g -> A_g+1, resid A_g -> A_g+1, and the grads.

    A->F direction carries m2n and n2m_grad; F->A carries n2m and m2n_grad (each token once per F rank).
    """

    m2n: float
    n2m: float
    m2n_grad: float
    n2m_grad: float
    resid: float
    resid_grad: float

    @property
    def a_to_f(self) -> float:
        return self.m2n + self.n2m_grad

    @property
    def f_to_a(self) -> float:
        return self.n2m + self.m2n_grad


def causal_pairs(seq_len: int, window: int = 0) -> float:
    """Query-key pairs of one causal sequence: s^2/2, or s*w - w^2/2 with a sliding window w < s."""
    if window and window < seq_len:
        return seq_len * window - window * window / 2
    return seq_len * seq_len / 2


def load_model_spec(path: str | Path) -> ModelSpec:
    """Read ``path`` (a model directory holding config.json, or the json file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--model {path}: no config.json there; pass a Hugging Face model directory or its config")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"--model {file}: not valid JSON ({err})") from err
    name = file.parent.name if file.name == "config.json" else file.stem
    return ModelSpec.from_config(cfg, name=name)


# ----- family field maps -----
def _int(cfg: dict[str, Any], *names: str, default: int | None = None) -> int:
    """First present, non-null field of ``names`` as an int; ConfigError naming the field if none is."""
    for name in names:
        value = cfg.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"config field {name} must be a non-negative integer, got {value!r}")
            return value
    if default is None:
        raise ConfigError(f"config.json lacks {' / '.join(names)} (model_type {cfg.get('model_type')!r})")
    return default


def _experts(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Routed/shared/dense MLP sizes: num_experts | num_local_experts | n_routed_experts, etc."""
    num_experts = _int(cfg, "num_experts", "num_local_experts", "n_routed_experts")
    top_k = _int(cfg, "num_experts_per_tok", "experts_per_token")
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"num_experts_per_tok ({top_k}) must be between 1 and the expert count ({num_experts})")
    deepseek, qwen = model_type.startswith("deepseek"), model_type in ("qwen2_moe", "qwen3_moe")
    expert_i = _int(cfg, "moe_intermediate_size") if deepseek or qwen else _int(cfg, "intermediate_size")
    shared = 0
    if model_type == "qwen2_moe":
        shared = _int(cfg, "shared_expert_intermediate_size", default=0)
    elif deepseek:
        shared = _int(cfg, "n_shared_experts", default=0) * expert_i
    return {
        "num_experts": num_experts,
        "top_k": top_k,
        "expert_intermediate": expert_i,
        "dense_intermediate": _int(cfg, "intermediate_size", default=0) if deepseek or qwen else 0,
        "shared_intermediate": shared,
        "shared_gate": model_type == "qwen2_moe" and shared > 0,
        "expert_bias": model_type == "gpt_oss",
        "router_bias": model_type == "gpt_oss",
    }


def _attention(cfg: dict[str, Any], model_type: str) -> AttentionSpec:
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    if model_type.startswith("deepseek"):
        rope, nope = _int(cfg, "qk_rope_head_dim"), _int(cfg, "qk_nope_head_dim")
        return AttentionSpec(
            kind="mla",
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=rope + nope,
            v_head_dim=_int(cfg, "v_head_dim"),
            q_lora_rank=_int(cfg, "q_lora_rank", default=0),
            kv_lora_rank=_int(cfg, "kv_lora_rank"),
            qk_rope_head_dim=rope,
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
        )
    head_dim = _int(cfg, "head_dim", default=hidden // heads)
    bias = bool(cfg.get("qkv_bias", True)) if model_type == "qwen2_moe" else bool(cfg.get("attention_bias", False))
    return AttentionSpec(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        v_head_dim=head_dim,
        qkv_bias=bias,
        o_bias=bias and model_type != "qwen2_moe",
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(model_type, ""),
        sinks=model_type == "gpt_oss",
    )


def _moe_layers(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[bool, ...]:
    """Which layers route: DeepSeek first_k_dense_replace; Qwen mlp_only_layers and decoder_sparse_step."""
    if model_type.startswith("deepseek"):
        first_dense = _int(cfg, "first_k_dense_replace", default=0 if model_type == "deepseek_v2" else 3)
        return tuple(i >= first_dense for i in range(num_layers))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        dense = set(cfg.get("mlp_only_layers") or [])
        step = _int(cfg, "decoder_sparse_step", default=1) or 1
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return (True,) * num_layers


def _windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """Per-layer sliding window (0 = full causal), from layer_types or each family's default rule."""
    window = cfg.get("sliding_window") or 0
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if model_type == "gpt_oss":
        return tuple(window if i % 2 == 0 else 0 for i in range(num_layers))
    if model_type in ("qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        return (0,) * num_layers
    if model_type == "qwen2_moe":
        last = _int(cfg, "max_window_layers", default=num_layers)
        return tuple(window if i % 2 == 0 and i < last else 0 for i in range(num_layers))
    if model_type in ("qwen3_moe", "mixtral"):
        return (window,) * num_layers
    return (0,) * num_layers


def _mla_params(a: AttentionSpec, h: int) -> int:
    """q (LoRA or direct), kv_a_proj_with_mqa, kv_b_proj, o_proj and the two latent norms."""
    q_heads = a.num_heads * a.head_dim
    q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * q_heads if a.q_lora_rank else h * q_heads
    q_bias = a.q_lora_rank if (a.qkv_bias and a.q_lora_rank) else 0
    kv_down = h * (a.kv_lora_rank + a.qk_rope_head_dim) + (a.kv_lora_rank + a.qk_rope_head_dim) * a.qkv_bias
    kv_up = a.kv_lora_rank * a.num_heads * (a.head_dim - a.qk_rope_head_dim + a.v_head_dim) + a.kv_lora_rank
    o = a.num_heads * a.v_head_dim * h + (h if a.o_bias else 0)
    return q + q_bias + kv_down + kv_up + o
