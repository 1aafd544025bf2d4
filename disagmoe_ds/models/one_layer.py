"""One MoE decoder layer of a real-size model, and its two parts as timed callables (benchmarks, profiles).

Shape suffixes: B micro-batch, S sequence, T = B*S tokens, H hidden, K top-k.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from disagmoe_ds.models.model_facts import num_routed_experts
from disagmoe_ds.models.parts import AttentionStage, ExpertStage, compile_stage

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def one_layer_model(
    config, *, device: str, dtype: torch.dtype, experts: str = "grouped_mm", layer: int = 0
) -> PreTrainedModel:
    """A causal LM with a single decoder layer of ``config``'s sizes, that layer made MoE (random weights), of the
    type (``config.layer_types``: full or linear attention, sliding window) of the model's layer ``layer``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    for dense_rule, value in (("first_k_dense_replace", 0), ("mlp_only_layers", []), ("decoder_sparse_step", 1)):
        if hasattr(config, dense_rule):
            setattr(config, dense_rule, value)
    if getattr(config, "layer_types", None):
        if not 0 <= layer < len(config.layer_types):
            raise ValueError(f"layer {layer} is not one of the model's {len(config.layer_types)} layers")
        config.layer_types = config.layer_types[layer : layer + 1]
    if getattr(config, "mlp_layer_types", None):  # DeepSeek-V4 lists its MLPs per layer too (a hash or learned router)
        config.mlp_layer_types = config.mlp_layer_types[layer : layer + 1]
    config._experts_implementation = experts  # not a from_config keyword in every transformers 5.x
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.set_experts_implementation(experts)
    return model.train()


def disagmoe_parts(
    config: Any,
    *,
    layer_index: int,
    seq_len: int,
    micro_batch_size: int,
    device: str,
    dtype: torch.dtype,
    compiled: bool = False,
) -> tuple[Callable[[], tuple], Callable[[], tuple]]:
    """Our attention part and expert shard (every expert on one rank) as ``disagmoe-plan profile`` measures them;
    ``compiled``: as a ``"compile": true`` job runs them.

    ``layer_index`` is ignored: the one-layer model's layer is made MoE, with the same sizes.
    """
    del layer_index
    model = one_layer_model(config, device=device, dtype=dtype, experts=config._experts_implementation or "eager")
    attention = AttentionStage(model, (0,), with_embedding=False, with_head=False)
    experts = ExpertStage(model, (0,), 0, num_routed_experts(model))
    if compiled:
        compile_stage(attention)
        compile_stage(experts)
    H = model.config.hidden_size
    h_BSH = torch.randn(micro_batch_size, seq_len, *attention.residual_dims, device=device, dtype=dtype)
    h_BSH.requires_grad_()
    token_ids_BS = torch.randint(0, model.config.vocab_size, (micro_batch_size, seq_len), device=device)
    ctx = attention.context(h_BSH, None, token_ids_BS)  # token ids: for a layer that routes by them

    def attention_fn() -> tuple:
        out = attention.part(0)(h_BSH, ctx, model.config)
        return (out.residual_BSH, out.x_TH, out.topk_w_TK)

    T, E, K = micro_batch_size * seq_len, num_routed_experts(model), model.config.num_experts_per_tok
    x_TH = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    idx_TK = torch.rand(T, E, device=device).topk(K, dim=-1).indices  # uniform routing
    w_TK = torch.softmax(torch.randn(T, K, device=device), dim=-1).to(dtype)

    def experts_fn() -> tuple:
        return (experts.shard(0)(x_TH, idx_TK, w_TK, idx_TK.numel()),)  # pairs known, as the M2N header gives them

    return attention_fn, experts_fn


def compiled_disagmoe_parts(config: Any, **kwargs: Any) -> tuple[Callable[[], tuple], Callable[[], tuple]]:
    """``disagmoe_parts`` compiled, as ``--parts disagmoe_ds.models.one_layer:compiled_disagmoe_parts``."""
    return disagmoe_parts(config, compiled=True, **kwargs)
