"""Per-layer FLOP, byte, parameter and activation model of a Hugging Face MoE config.json (pure Python).

The config is read as a JSON dict; transformers is not imported. ``hf_config.py`` maps each family's field
names (``hf_config.SUPPORTED_TYPES``) onto one vocabulary.

Counting conventions (Megatron-LM ``num_floating_point_operations``; Narayanan et al. 2021, appendix):

* a [m, k] x [k, n] matmul costs 2mkn FLOPs; elementwise work (norms, softmax, RoPE, activations) is not counted;
* backward costs 2x forward (dgrad + wgrad), so a training step costs 3x forward (4x with full recompute);
* causal attention core: a sequence of s tokens has s^2/2 query-key pairs (the diagonal's s/2 is dropped,
  Megatron's "only half of the attention matrix is non-zero"); a sliding window w keeps s*w - w^2/2 pairs
  when s > w. A pair costs 2*d_qk FLOPs per head for the scores and 2*d_v for the weighted sum of values.
* linear attention core (Gated DeltaNet layers of Qwen3-Next / Qwen3.5, ``linear_attention_core_flops``): the
  chunked gated delta rule costs the same per token whatever s, so a layer's cost is linear in the sequence
  length. Per token and value head, within its chunk of C = 64 tokens: K_beta K^T, the UT transform's products
  with V_beta and K_beta, Q K^T and the intra-chunk attention times the new values, 2*C*(3*d_k + 2*d_v); against
  the chunk's d_k x d_v state, two reads and one update, 6*d_k*d_v. The triangular solve (about 2*C^2/3, under
  4% at HF's head sizes) is not counted.

DeepSeek-V4 (``compressed``, ``hc_streams``): its attention's terms are ``compressed_attention``'s, and its
hyper-connections add their projections and stream mixes to every layer's A side, the hyper head to the head, and
their streams to the residual hand-off (hc x H per token, plus the routed sum's hc weights and, where some layer
routes by token id, the token ids) and to what a layer keeps.

The split follows the runtime (``docs/architecture.md``): the A side holds norms, attention, router, shared
experts, dense MLP layers, embedding and LM head; the F side holds the routed experts only.

>>> spec = ModelSpec.from_config({"model_type": "mixtral", "hidden_size": 8, "num_hidden_layers": 2,
...     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16, "intermediate_size": 4,
...     "num_local_experts": 4, "num_experts_per_tok": 2})
>>> spec.routed_flops_per_token(), spec.attention_projection_flops()
(384, 384)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from disagmoe_ds.planner.compressed_attention import (
    CompressedAttentionSpec,
    hyper_connection_flops,
    hyper_connection_params,
    hyper_head_params,
)
from disagmoe_ds.planner.hf_config import AttentionSpec, LinearAttentionSpec, model_fields, read_model_config

ACT_BYTES = 2  # bf16 activations and wire format of hidden states
FP8_ROW_SCALE_BYTES = 4  # the float32 scale of an e4m3 row in the FP8 exchange
DELTA_RULE_CHUNK = 64  # chunk length of the chunked gated delta rule (HF's torch path and flash-linear-attention)
ID_BYTES = 4  # int32 expert ids on the wire (one per chosen expert)
TOKEN_ID_BYTES = 8  # int64 token ids in the residual hand-off (DeepSeek-V4's hash-routed layers)
WEIGHT_BYTES = 4  # fp32 routing weights on the wire (one per chosen expert)


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts of an MoE decoder the planner needs, family differences already resolved.

    ``moe_layers[i]`` is True where layer i has routed experts; ``windows[i]`` is its sliding window or 0;
    ``linear_layers[i]`` is True where its token mixer is ``linear_attention`` (Gated DeltaNet) instead.
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
    linear_attention: LinearAttentionSpec | None = None
    linear_layers: tuple[bool, ...] = ()
    compressed: CompressedAttentionSpec | None = None  # DeepSeek-V4's attention
    hc_streams: int = 1  # residual streams per token (hyper-connections)
    token_routed: bool = False  # some layer routes by token id: the hand-off carries the ids

    def __hash__(self) -> int:
        """The fields' hash, as the dataclass's, kept once computed: the search's caches hash the spec millions of
        times, and its three per-layer tuples make that the costliest key. Not pickled (str hashes are per process)."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    # ----- construction -----
    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str = "") -> ModelSpec:
        """Build from a config.json dict; raises ``UnsupportedModelError`` / ``ConfigError`` with the field name."""
        found = model_fields(cfg)
        return cls(name=name or found["model_type"], **found)

    # ----- per-token forward FLOPs -----
    def is_linear(self, layer: int | None) -> bool:
        """Whether ``layer``'s token mixer is linear attention (None: the softmax-attention layers' figure)."""
        return layer is not None and bool(self.linear_layers) and self.linear_layers[layer]

    def attention_projection_flops(self, layer: int | None = None) -> int:
        """Q, K, V and O projections per token (GQA) or the MLA down/up projections (Megatron MLA term); of a
        linear-attention ``layer``, its projections and depthwise conv (``linear_projection_flops``)."""
        if self.is_linear(layer):
            return self.linear_projection_flops()
        a, h = self.attention, self.hidden_size
        if self.compressed is not None:
            return self.compressed.projection_flops(h, layer)
        if a.kind == "gqa":
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            gate = 2 * h * q if a.output_gate else 0
            return 2 * h * q + 2 * 2 * h * kv + 2 * q * h + gate
        q_heads = a.num_heads * a.head_dim
        q = 2 * (h * a.q_lora_rank + a.q_lora_rank * q_heads) if a.q_lora_rank else 2 * h * q_heads
        kv_down = 2 * h * (a.kv_lora_rank + a.qk_rope_head_dim)
        kv_up = 2 * a.kv_lora_rank * a.num_heads * (a.head_dim - a.qk_rope_head_dim + a.v_head_dim)
        return q + kv_down + kv_up + 2 * a.num_heads * a.v_head_dim * h

    def attention_core_flops(self, seq_len: int, layer: int) -> float:
        """Scores and weighted sum per token, averaged over a causal sequence of ``seq_len`` (module docstring);
        a linear-attention layer's delta rule instead (``linear_attention_core_flops``)."""
        if self.is_linear(layer):
            return self.linear_attention_core_flops(seq_len)
        if self.compressed is not None:
            return self.compressed.core_flops(seq_len, layer, causal_pairs(seq_len, self.windows[layer]))
        a = self.attention
        per_pair = 2 * a.num_heads * (a.head_dim + a.v_head_dim)
        return per_pair * causal_pairs(seq_len, self.windows[layer]) / seq_len

    def linear_projection_flops(self) -> int:
        """Gated DeltaNet per token: in-projections to q, k, v, z and beta, decay; out_proj; the depthwise conv."""
        la, h = _linear(self), self.hidden_size
        conv_dim = 2 * la.key_dim + la.value_dim
        in_proj = 2 * h * (conv_dim + la.value_dim + 2 * la.num_v_heads)
        return in_proj + 2 * la.value_dim * h + 2 * conv_dim * la.conv_kernel

    def linear_attention_core_flops(self, seq_len: int) -> float:
        """The chunked gated delta rule per token (module docstring): no term grows with ``seq_len``, except that
        a sequence shorter than a chunk is computed in one chunk of its own length."""
        la = _linear(self)
        chunk = min(DELTA_RULE_CHUNK, seq_len)
        dk, dv = la.head_k_dim, la.head_v_dim
        return la.num_v_heads * (2 * chunk * (3 * dk + 2 * dv) + 6 * dk * dv)

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
        """The LM head, and with hyper-connections the hyper head's projection of the streams."""
        h, hc = self.hidden_size, self.hc_streams
        return 2 * h * self.vocab_size + (2 * hc * h * hc if hc > 1 else 0)

    def hyper_flops(self) -> int:
        """A layer's two hyper-connections (0 without): projections of the streams and their mixes."""
        return 2 * hyper_connection_flops(self.hidden_size, self.hc_streams) if self.hc_streams > 1 else 0

    def attention_side_flops(self, seq_len: int, layer: int) -> float:
        """A-side forward FLOPs per token of ``layer``: attention, then router + shared or the dense MLP (and the
        hyper-connections around both)."""
        attn = self.attention_projection_flops(layer) + self.attention_core_flops(seq_len, layer) + self.hyper_flops()
        if self.moe_layers[layer]:
            return attn + self.router_flops() + self.shared_flops()
        return attn + self.dense_mlp_flops()

    def a_side_linear_flops(self, layer: int) -> int:
        """The weight GEMMs of ``attention_side_flops`` (all but the attention core)."""
        mlp = self.router_flops() + self.shared_flops() if self.moe_layers[layer] else self.dense_mlp_flops()
        return self.attention_projection_flops(layer) + mlp + self.hyper_flops()

    def expert_side_flops(self, layer: int) -> int:
        """F-side forward FLOPs per token of ``layer`` (0 for a dense layer)."""
        return self.routed_flops_per_token() if self.moe_layers[layer] else 0

    def step_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of fwd + bwd per token over the whole model (3x forward; recompute not counted)."""
        fwd = sum(self.attention_side_flops(seq_len, i) + self.expert_side_flops(i) for i in range(self.num_layers))
        return 3 * (fwd + self.head_flops())

    # ----- parameters -----
    def attention_params(self, layer: int | None = None) -> int:
        """One layer's token-mixer parameters (self-attention, or a linear-attention ``layer``'s Gated DeltaNet)
        including the two layer norms around it."""
        a, h = self.attention, self.hidden_size
        norms = 2 * h
        if self.is_linear(layer):
            return norms + _linear_params(_linear(self), h)
        if self.compressed is not None:
            hyper = 2 * hyper_connection_params(h, self.hc_streams) if self.hc_streams > 1 else 0
            return norms + self.compressed.params(h, layer) + hyper
        if a.kind == "mla":
            return norms + _mla_params(a, h)
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        weights = h * q + 2 * h * kv + q * h + (h * q if a.output_gate else 0)
        bias = (q + 2 * kv if a.qkv_bias else 0) + (h if a.o_bias else 0)
        qk_norm = {"": 0, "head": 2 * a.head_dim, "full": q + kv}[a.qk_norm]
        return norms + weights + bias + qk_norm + (a.num_heads if a.sinks else 0)

    def a_side_params(self, layer: int) -> int:
        """A-side parameters of one layer: attention + norms + router + shared experts, or the dense MLP."""
        h = self.hidden_size
        if not self.moe_layers[layer]:
            return self.attention_params(layer) + 3 * h * self.dense_intermediate
        shared = 3 * h * self.shared_intermediate + (h if self.shared_gate else 0)
        return self.attention_params(layer) + self.router_params() + shared

    def router_params(self) -> int:
        """One MoE layer's router: E x H weights, plus GPT-OSS's bias (ERNIE's correction bias)."""
        return self.num_experts * self.hidden_size + (self.num_experts if self.router_bias else 0)

    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up, down, plus GPT-OSS biases)."""
        h, i = self.hidden_size, self.expert_intermediate
        return 3 * h * i + (2 * i + h if self.expert_bias else 0)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """Final norm plus the LM head (nothing extra for the head when it is tied to the embedding), and with
        hyper-connections the hyper head."""
        h = self.hidden_size
        hyper = hyper_head_params(h, self.hc_streams) if self.hc_streams > 1 else 0
        return h + (0 if self.tie_word_embeddings else self.vocab_size * h) + hyper

    def total_params(self) -> int:
        experts = sum(self.num_experts * self.expert_params() for i in range(self.num_layers) if self.moe_layers[i])
        dense = sum(self.a_side_params(i) for i in range(self.num_layers))
        return dense + experts + self.embedding_params() + self.head_params()

    # ----- activations (bytes kept for backward, per token, no recompute) -----
    def a_side_activation_bytes(self, layer: int) -> int:
        """Tensors autograd keeps for one token of one layer on the A side (bf16; flash-style attention).

        Layer input and the two norm outputs, Q/K/V, attention output and its log-sum-exp, the pre-norm
        residual, router logits and probabilities (fp32), and the SwiGLU intermediates of shared/dense MLPs. A
        linear-attention layer keeps its projections, the conv output, the delta rule's output and gated norm, and
        per chunk the fp32 state of every value head (``linear_attention_bytes``).
        """
        a, h = self.attention, self.hidden_size
        if self.compressed is not None:  # at a 4K sequence (the keys kept per query do not grow past the window)
            attn = self.compressed.activation_bytes(ACT_BYTES, layer, 4096) + self.hyper_activation_bytes()
            attn += ACT_BYTES * 4 * h
        elif self.is_linear(layer):
            attn = self.linear_attention_bytes()
        elif a.kind == "gqa":
            qkv = a.num_heads * a.head_dim + 2 * a.num_kv_heads * a.head_dim
        else:
            latent = a.q_lora_rank * 2 + (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
            qkv = latent + 2 * a.num_heads * a.head_dim + a.num_heads * a.v_head_dim
        if not self.is_linear(layer) and self.compressed is None:
            gate = a.num_heads * a.head_dim if a.output_gate else 0
            attn = ACT_BYTES * (4 * h + qkv + gate + a.num_heads * a.v_head_dim) + 4 * a.num_heads
        if not self.moe_layers[layer]:
            return attn + ACT_BYTES * 3 * self.dense_intermediate
        return attn + 2 * 4 * self.num_experts + ACT_BYTES * 3 * self.shared_intermediate

    def hyper_activation_bytes(self) -> int:
        """Per token of a layer with hyper-connections: the streams before and after the token mixer (hc x H each)
        and the two connections' fp32 projections ((2 + hc) hc each) and weights."""
        hc = self.hc_streams
        return ACT_BYTES * 2 * hc * self.hidden_size + 2 * 4 * 2 * (2 + hc) * hc

    def linear_attention_bytes(self) -> int:
        """Per token of a Gated DeltaNet block: layer input and norms, projections, conv output, delta-rule output,
        gated norm output, and the fp32 chunk states (``num_v_heads`` x d_k x d_v per chunk of 64 tokens)."""
        la, h = _linear(self), self.hidden_size
        conv_dim = 2 * la.key_dim + la.value_dim
        kept = 4 * h + (conv_dim + la.value_dim + 2 * la.num_v_heads) + conv_dim + 2 * la.value_dim
        return ACT_BYTES * kept + 4 * la.num_v_heads * la.head_k_dim * la.head_v_dim // DELTA_RULE_CHUNK

    def f_side_activation_bytes_per_assignment(self) -> int:
        """Per (token, chosen expert) on the F side: gathered input, gate/up output, activation, expert output."""
        return ACT_BYTES * (2 * self.hidden_size + 3 * self.expert_intermediate)

    def layer_input_bytes(self) -> int:
        """What full recompute keeps per token and layer: the layer input (Megatron full recompute; hc streams with
        hyper-connections)."""
        return ACT_BYTES * self.hidden_size * self.hc_streams

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

    def wire_bytes_per_token(self, ep_size: int, *, fp8: bool = False) -> WireBytes:
        """Bytes per token and MoE layer on each AF-Pipe channel (``WireBytes``); ``fp8``: the m2n rows (and so their
        resend copies) in e4m3 with a float32 scale each, the FP8 exchange (the other channels stay bf16)."""
        h, k = ACT_BYTES * self.hidden_size, self.top_k
        x = self.hidden_size + FP8_ROW_SCALE_BYTES if fp8 else h
        ranks = self.distinct_ranks_per_token(ep_size)
        hc = self.hc_streams  # the residual's streams, and with them the routed sum's weight per stream
        weights = ACT_BYTES * hc if hc > 1 else 0
        ids = TOKEN_ID_BYTES if self.token_routed else 0
        return WireBytes(
            m2n=ranks * (x + k * (ID_BYTES + WEIGHT_BYTES)),
            n2m=ranks * h,
            n2m_grad=ranks * h,
            m2n_grad=ranks * (h + k * WEIGHT_BYTES),
            resid=hc * h + weights + ids + k * ID_BYTES,
            resid_grad=hc * h + weights,
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
    cfg, name = read_model_config(path)
    return ModelSpec.from_config(cfg, name=name)


def _linear(spec: ModelSpec) -> LinearAttentionSpec:
    if spec.linear_attention is None:
        raise ValueError(f"{spec.name} has no linear-attention layer")
    return spec.linear_attention


def _linear_params(la: LinearAttentionSpec, h: int) -> int:
    """in_proj (q, k, v, z, beta, decay), the depthwise conv, dt_bias and A_log per value head, the gated norm,
    out_proj."""
    conv_dim = 2 * la.key_dim + la.value_dim
    in_proj = h * (conv_dim + la.value_dim + 2 * la.num_v_heads)
    return in_proj + conv_dim * la.conv_kernel + 2 * la.num_v_heads + la.head_v_dim + la.value_dim * h


def _mla_params(a: AttentionSpec, h: int) -> int:
    """q (LoRA or direct), kv_a_proj_with_mqa, kv_b_proj, o_proj and the two latent norms."""
    q_heads = a.num_heads * a.head_dim
    q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * q_heads if a.q_lora_rank else h * q_heads
    q_bias = a.q_lora_rank if (a.qkv_bias and a.q_lora_rank) else 0
    kv_down = h * (a.kv_lora_rank + a.qk_rope_head_dim) + (a.kv_lora_rank + a.qk_rope_head_dim) * a.qkv_bias
    kv_up = a.kv_lora_rank * a.num_heads * (a.head_dim - a.qk_rope_head_dim + a.v_head_dim) + a.kv_lora_rank
    o = a.num_heads * a.v_head_dim * h + (h if a.o_bias else 0)
    d = a.indexer_head_dim  # DeepSeek-V3.2's indexer: wq_b from the query latent, wk, its LayerNorm, weights_proj
    indexer = a.q_lora_rank * a.indexer_heads * d + h * d + 2 * d + h * a.indexer_heads if a.indexer_heads else 0
    return q + q_bias + kv_down + kv_up + o + indexer
