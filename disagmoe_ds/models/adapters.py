"""Adding LoRA adapters (``models.lora``) to a built rank module, and checking the targets before launch.

``add_adapters`` works on either mode's module: it finds the ``AttentionStage`` and ``ExpertStage`` inside, adds
the adapters the settings target and freezes everything else. The initial values depend only on the run seed and
each tensor's HF name, so every layout starts from the same adapters (and ``verify`` hands them to its PEFT
reference); the expert tensors are drawn whole and sliced.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.fp8.frozen import BlockFp8Linear, model_dtype_of
from disagmoe_ds.models.attention_part import AttentionPart
from disagmoe_ds.models.lora import SCALING_ATTR, LoraLinear, is_adapter
from disagmoe_ds.models.lora_settings import EXPERT_PROJECTIONS, GROUPS, A, B, LoraSettings
from disagmoe_ds.models.model_facts import num_experts_of
from disagmoe_ds.models.naming import attention_name_to_hf, expert_name_to_hf
from disagmoe_ds.models.parts import AttentionStage, ExpertStage


def add_adapters(module: nn.Module, settings: LoraSettings, *, seed: int) -> None:
    """Adapters on every part of ``module`` that ``settings`` targets, everything else frozen (the routers train
    with ``train_router``); DeepSpeed's expert-parallel marks are copied from each weight to its adapters."""
    for stage in list(module.modules()):
        if isinstance(stage, AttentionStage):
            _adapt_attention(stage, settings, seed)
        elif isinstance(stage, ExpertStage) and settings.experts:
            _adapt_experts(stage, settings, seed)
    _freeze_base(module, settings)


def _adapt_attention(stage: AttentionStage, settings: LoraSettings, seed: int) -> None:
    for layer in stage.layers:
        part = stage.part(int(layer))
        for group, root, prefix in (("attention", part.mixer, part.mixer_attr), ("mlp", part.mlp, "mlp")):
            for name, linear in list(_linears(root, skip=part.router if part.is_moe else None)):
                if not settings.adapts(group, name.rpartition(".")[2]):
                    continue
                adapted = LoraLinear(linear, settings.rank, settings.scaling, settings.dropout)
                hf = attention_name_to_hf(f"layers.{layer}.{prefix}.{name}")
                _init_pair(adapted.lora_A, adapted.lora_B, hf, settings, seed)
                owner, _, attr = name.rpartition(".")
                setattr(root.get_submodule(owner) if owner else root, attr, adapted)


def _linears(root: nn.Module, skip: nn.Module | None):
    """``(name, module)`` of every plain ``nn.Linear`` (or one holding a frozen FP8 weight) under ``root``, outside
    ``skip`` (the router)."""
    skipped = set() if skip is None else {id(m) for m in skip.modules()}
    for name, sub in root.named_modules():
        if type(sub) in (nn.Linear, BlockFp8Linear) and id(sub) not in skipped and name:
            yield name, sub


def _adapt_experts(stage: ExpertStage, settings: LoraSettings, seed: int) -> None:
    num_experts = num_experts_of(stage.config)
    for layer in stage.layers:
        shard = stage.shard(int(layer))
        experts = shard.experts
        transposed = bool(getattr(experts, "is_transposed", False))
        for proj in EXPERT_PROJECTIONS:
            weight = getattr(experts, proj)
            out_dim, in_dim = (weight.shape[2], weight.shape[1]) if transposed else weight.shape[1:]
            dtype = model_dtype_of(experts, proj)  # an FP8 base's: the model's dtype
            a = torch.zeros(shard.num_local, settings.rank, in_dim, dtype=dtype, device=weight.device)
            b = torch.zeros(shard.num_local, out_dim, settings.rank, dtype=dtype, device=weight.device)
            hf = expert_name_to_hf(f"layers.{layer}.experts.{proj}")
            rows = slice(shard.first_expert, shard.first_expert + shard.num_local)
            _init_pair(a, b, hf, settings, seed, experts=(num_experts, rows))
            for suffix, value in ((A, a), (B, b)):
                param = nn.Parameter(value)
                for mark in ("allreduce", "group_name"):  # colocated: DeepSpeed reduces them as expert parameters
                    if hasattr(weight, mark):
                        setattr(param, mark, getattr(weight, mark))
                experts.register_parameter(f"{proj}_{suffix}", param)
        setattr(experts, SCALING_ATTR, settings.scaling)


def _init_pair(
    a: torch.Tensor,
    b: torch.Tensor,
    hf_name: str,
    settings: LoraSettings,
    seed: int,
    *,
    experts: tuple[int, slice] | None = None,
) -> None:
    """PEFT's initial values: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt 5), B zero or, without
    ``init_lora_weights``, U(-1/sqrt(out), 1/sqrt(out)), an update about the size of the base weights (PEFT's own
    1/sqrt(r) would swamp them; the values are handed to PEFT anyway). Drawn from the seed and the tensor's HF name
    alone; an expert shard's rows are cut from the whole layer's draw (``experts``: E and the rows)."""
    with torch.no_grad():
        for tensor, suffix, fan_in in ((a, A, a.shape[-1]), (b, B, b.shape[-2])):
            if suffix == B and settings.init_lora_weights:
                tensor.zero_()
                continue
            shape = tensor.shape if experts is None else (experts[0], *tensor.shape[1:])
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{hf_name}.{suffix}".encode()))
            value = (torch.rand(shape, generator=gen) * 2 - 1) / math.sqrt(fan_in)
            tensor.copy_(value if experts is None else value[experts[1]])


def _freeze_base(module: nn.Module, settings: LoraSettings) -> None:
    """Only adapters train, and with ``train_router`` each router's weight (not DeepSeek-V3's correction bias,
    which keeps its own update rule)."""
    routers = set()
    if settings.train_router:
        parts = [m for m in module.modules() if isinstance(m, AttentionPart) and m.is_moe]
        routers = {id(part.router.get_parameter(part.family.router_weight)) for part in parts}
    for name, param in module.named_parameters():
        param.requires_grad_(is_adapter(name) or id(param) in routers)


def check_lora(config, settings: LoraSettings, *, needs: tuple[str, ...] = ()) -> None:
    """Refuse targets that name nothing in the model (before any rank starts; the model is built on the meta
    device), and targets that leave one of the sides in ``needs`` (``attention``, ``expert``) nothing to train: its
    DeepSpeed engine needs parameters to train (the attention side trains the routers with ``train_router``)."""
    linears = attention_side_linears(config)
    seen = {leaf for _, _, leaf in linears}
    attention = any(settings.adapts(group, leaf) for _, group, leaf in linears)
    unknown = [t for t in settings.targets if t not in GROUPS and t not in seen]
    if unknown:
        raise ConfigError(
            f'"disagmoe.lora.targets" names {", ".join(unknown)}, which the {config.model_type} model has no '
            f"projection called; use {', '.join(GROUPS)} or one of {', '.join(sorted(seen))}"
        )
    trains = {"attention": attention or settings.train_router, "expert": settings.experts}
    idle = [side for side in needs if not trains[side]]
    if idle:
        fix = "add experts to the targets" if idle[0] == "expert" else "add attention or mlp, or train the routers"
        raise ConfigError(
            f'"disagmoe.lora.targets" {list(settings.targets)} leave the {idle[0]} side nothing to train, and its '
            f"DeepSpeed engines need parameters to train; {fix} (--lora-targets, --lora-train-router)"
        )


def attention_side_linears(config) -> list[tuple[str, str, str]]:
    """``(HF module name, group, leaf name)`` of every ``nn.Linear`` an attention-side adapter could wrap, read off a
    meta model: the token mixer's (group ``attention``) and the dense or shared MLPs' (``mlp``), routers excluded."""
    from transformers import AutoModelForCausalLM

    from disagmoe_ds.models.families import family_of, is_moe_layer, mixer_attr

    family = family_of(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    found = []
    for i, layer in enumerate(model.model.layers):
        moe = is_moe_layer(layer)
        skip = getattr(layer.mlp, family.router_attr) if moe else None
        mlp = nn.ModuleDict({k: m for k, m in layer.mlp.named_children() if k != "experts"}) if moe else layer.mlp
        for group, prefix, root in (("attention", mixer_attr(layer), getattr(layer, mixer_attr(layer))),
                                    ("mlp", "mlp", mlp)):  # fmt: skip
            found += [(f"model.layers.{i}.{prefix}.{name}", group, name.rpartition(".")[2])
                      for name, _ in _linears(root, skip=skip)]  # fmt: skip
    return found
