"""Selective recompute: which tensors a layer drops after its forward, and the FLOPs the backward spends to
rebuild them (pure Python).

Three policies, for the A part, the F part and the co-located layer alike:

* ``none``: autograd keeps everything ``ModelSpec.*_activation_bytes`` lists.
* ``selective`` (Megatron's ``--recompute-modules core_attn mla_up_proj moe_act shared_experts``, done for
  the matmuls too): the attention input (the input-norm output, kept anyway) stays, Q/K/V (for MLA the
  up-projected heads; the latents stay), the attention output and its log-sum-exp are dropped; every SwiGLU
  (routed experts, shared experts, dense MLP) drops its gate, up and activation outputs and keeps its input.
  The backward re-runs the Q/K/V (MLA: q_b/kv_b) projections, the attention core forward and the gate/up
  GEMMs. Nothing else changes, so the recompute costs exactly these forward FLOPs again. That is the co-located
  baseline's (Megatron's) policy. AF-Pipe's runtime (``models/recompute.py``) drops the same tensors but
  checkpoints the attention block and the shared/dense SwiGLU as whole modules, so its backward also re-runs their
  output and down projections (``whole_blocks``); its routed experts re-run the gate/up GEMM only, as here.
* ``full``: only the layer input stays; the backward re-runs the whole forward (``memory.py``).

Bytes are bf16 (``ACT_BYTES``) except the log-sum-exp (fp32, one per head). FLOPs follow ``model.py``'s
conventions (2mkn per matmul; elementwise work is free).

>>> from disagmoe_ds.planner.model import ModelSpec
>>> spec = ModelSpec.from_config({"model_type": "mixtral", "hidden_size": 8, "num_hidden_layers": 1,
...     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16, "intermediate_size": 4,
...     "num_local_experts": 4, "num_experts_per_tok": 2})
>>> expert_saved_bytes_per_assignment(spec), expert_recompute_flops_per_assignment(spec)
(24, 128)
"""

from __future__ import annotations

from typing import Literal

from disagmoe_ds.planner.model import ACT_BYTES, ModelSpec

Recompute = Literal["none", "selective", "full"]
LSE_BYTES = 4  # fp32 log-sum-exp per head and token, kept by flash-style attention


def attention_saved_bytes(spec: ModelSpec) -> int:
    """Per token: Q/K/V (MLA: the up-projected q, k, v), attention output and log-sum-exp."""
    a = spec.attention
    if a.kind == "gqa":
        qkv = a.num_heads * a.head_dim + 2 * a.num_kv_heads * a.head_dim
    else:
        qkv = 2 * a.num_heads * a.head_dim + a.num_heads * a.v_head_dim
    return ACT_BYTES * (qkv + a.num_heads * a.v_head_dim) + LSE_BYTES * a.num_heads


def attention_recompute_linear_flops(spec: ModelSpec) -> int:
    """Per token: the projections that rebuild Q/K/V (GQA: q, k, v; MLA: q_b or q_proj, and kv_b)."""
    a, h = spec.attention, spec.hidden_size
    if a.kind == "gqa":
        return 2 * h * a.num_heads * a.head_dim + 4 * h * a.num_kv_heads * a.head_dim
    q_in = a.q_lora_rank or h
    kv_up = 2 * a.kv_lora_rank * a.num_heads * (a.head_dim - a.qk_rope_head_dim + a.v_head_dim)
    return 2 * q_in * a.num_heads * a.head_dim + kv_up


def mlp_saved_bytes(intermediate: int) -> int:
    """Per token of one SwiGLU: gate output, up output and activation output."""
    return ACT_BYTES * 3 * intermediate


def mlp_recompute_flops(hidden: int, intermediate: int) -> int:
    """Per token of one SwiGLU: the gate and up GEMMs."""
    return 4 * hidden * intermediate


def a_side_saved_bytes(spec: ModelSpec, layer: int) -> int:
    """Per token of ``layer``'s A part under selective recompute."""
    width = spec.shared_intermediate if spec.moe_layers[layer] else spec.dense_intermediate
    return attention_saved_bytes(spec) + mlp_saved_bytes(width)


def a_side_recompute_flops(
    spec: ModelSpec, seq_len: int, layer: int, *, whole_blocks: bool = False
) -> tuple[float, float]:
    """(linear, attention-core) forward FLOPs per token that selective recompute adds to ``layer``'s backward;
    ``whole_blocks``: every projection of the attention block and of the shared/dense SwiGLU (AF-Pipe's runtime)."""
    core = spec.attention_core_flops(seq_len, layer)
    if whole_blocks:
        mlp = spec.shared_flops() if spec.moe_layers[layer] else spec.dense_mlp_flops()
        return float(spec.attention_projection_flops(layer) + mlp), core
    width = spec.shared_intermediate if spec.moe_layers[layer] else spec.dense_intermediate
    linear = attention_recompute_linear_flops(spec) + mlp_recompute_flops(spec.hidden_size, width)
    return float(linear), core


def expert_saved_bytes_per_assignment(spec: ModelSpec) -> int:
    return mlp_saved_bytes(spec.expert_intermediate)


def expert_recompute_flops_per_assignment(spec: ModelSpec) -> int:
    return mlp_recompute_flops(spec.hidden_size, spec.expert_intermediate)


def recompute_flops_per_token(spec: ModelSpec, seq_len: int, policy: Recompute, *, whole_blocks: bool = False) -> float:
    """Forward FLOPs per token the backward re-runs over the whole model (the head is never recomputed)."""
    if policy == "none":
        return 0.0
    total = 0.0
    for i in range(spec.num_layers):
        if policy == "full":
            total += spec.attention_side_flops(seq_len, i) + spec.expert_side_flops(i)
            continue
        total += sum(a_side_recompute_flops(spec, seq_len, i, whole_blocks=whole_blocks))
        total += spec.top_k * expert_recompute_flops_per_assignment(spec) if spec.moe_layers[i] else 0
    return total
