"""Our LoRA tensors (HF names, ``models.lora``) in PEFT's terms: its adapter directory, its model, merged weights.

Ours and PEFT's differ only in names and in the layout of the expert factors. PEFT's ``target_parameters`` keeps an
expert projection's factors as one ``nn.Linear`` pair: ``lora_A [E*r, in]`` (row ``e*r + j``) and ``lora_B
[out, r*E]`` (column ``j*E + e``); ours are ``[E, r, in]`` and ``[E, out, r]``. Two adapted parameters of one experts
module nest: the one registered first sits under ``base_layer.`` (checked against PEFT by the tests).

    model.layers.0.self_attn.q_proj.lora_A        base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
    model.layers.1.mlp.experts.gate_up_proj_lora_A base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight
    model.layers.1.mlp.experts.down_proj_lora_B    base_model.model.model.layers.1.mlp.experts.lora_B.weight
    model.layers.1.mlp.gate.weight (train_router)  base_model.model.model.layers.1.mlp.gate.weight (modules_to_save)
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.models.lora import expert_delta, is_adapter
from disagmoe_ds.models.lora_settings import EXPERT_PROJECTIONS, A, B, LoraSettings

PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
EXPERT_SUFFIXES = tuple(f"{p}_{ab}" for p in EXPERT_PROJECTIONS for ab in (A, B))


def _split(name: str) -> tuple[str, str]:
    """``(module, leaf)`` of a tensor name."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def router_modules(config, names: Any) -> list[str]:
    """The router modules (HF names) among ``names``' owners: what a trained router exports as PEFT's
    ``modules_to_save``."""
    from disagmoe_ds.models.families import family_of

    family = family_of(config)
    suffix = f".mlp.{family.router_attr}.{family.router_weight}"
    return sorted({n[: -len(family.router_weight) - 1] for n in names if n.endswith(suffix)})


def lora_config(settings: LoraSettings, names: Any, *, base_model: str | None = None, routers: Sequence[str] = ()):
    """PEFT's ``LoraConfig`` of the adapters named ``names`` (our HF names): the exact modules adapted, the expert
    parameters, the routers trained in full."""
    from peft import LoraConfig

    modules = sorted({_split(n)[0] for n in names if _split(n)[1] in (A, B)})
    experts = sorted({_split(n)[1].rsplit("_lora_", 1)[0] for n in names if _split(n)[1] in EXPERT_SUFFIXES})
    return LoraConfig(
        r=settings.rank,
        # PEFT annotates lora_alpha int but scales by lora_alpha / r: a float alpha works as it does in our adapters
        lora_alpha=settings.rank if settings.alpha is None else settings.alpha,  # type: ignore[arg-type]
        lora_dropout=settings.dropout,
        target_modules=modules or None,
        target_parameters=[f"mlp.experts.{p}" for p in EXPERT_PROJECTIONS if p in experts] or None,
        modules_to_save=list(routers) or None,
        base_model_name_or_path=base_model,
        init_lora_weights=settings.init_lora_weights,
    )


def to_peft(tensors: Mapping[str, torch.Tensor], routers: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """PEFT's adapter state (``adapter_model.safetensors`` keys) of our adapter tensors and trained routers."""
    out: dict[str, torch.Tensor] = {}
    nested = _expert_nesting(tensors)
    for name, value in tensors.items():
        module, leaf = _split(name)
        if leaf in (A, B):
            out[f"{PREFIX}{name}.weight"] = value
        elif leaf in EXPERT_SUFFIXES:
            proj, ab = leaf.rsplit("_", 2)[0], leaf[-6:]
            wrapper = module + ".base_layer" * nested[(module, proj)]
            out[f"{PREFIX}{wrapper}.{ab}.weight"] = _expert_to_peft(value, ab)
        elif any(name.startswith(r + ".") for r in routers):
            out[f"{PREFIX}{name}"] = value
    return out


def _expert_nesting(tensors: Mapping[str, torch.Tensor]) -> dict[tuple[str, str], int]:
    """How deep each adapted expert projection's PEFT wrapper sits: the first registered is the innermost."""
    adapted: dict[str, list[str]] = {}
    for name in tensors:
        module, leaf = _split(name)
        if leaf in EXPERT_SUFFIXES and leaf.endswith(A):
            adapted.setdefault(module, []).append(leaf[: -len(A) - 1])
    depth = {}
    for module, projs in adapted.items():
        ordered = [p for p in EXPERT_PROJECTIONS if p in projs]
        depth.update({(module, p): len(ordered) - 1 - i for i, p in enumerate(ordered)})
    return depth


def _expert_to_peft(value: torch.Tensor, ab: str) -> torch.Tensor:
    if ab == A:  # [E, r, in] -> [E*r, in]
        return value.reshape(-1, value.shape[-1]).contiguous()
    return value.permute(1, 2, 0).reshape(value.shape[1], -1).contiguous()  # [E, out, r] -> [out, r*E]


def _expert_from_peft(value: torch.Tensor, ab: str, num_experts: int) -> torch.Tensor:
    if ab == A:
        return value.reshape(num_experts, -1, value.shape[-1])
    return value.reshape(value.shape[0], -1, num_experts).permute(2, 0, 1)


def write_adapter(
    tensors: Mapping[str, torch.Tensor],
    settings: LoraSettings,
    out: Path,
    *,
    config,
    base_model: str,
    dtype: torch.dtype,
    tokenizer_dir: Path | None = None,
    tokenizer: Any = None,
) -> Path:
    """A PEFT adapter directory of the adapters (and trained routers) in ``tensors``, written atomically with the
    run's tokenizer (a checkpoint's ``tokenizer_dir`` or a ``data.Tokenizer``) where given:
    ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), out)`` loads it."""
    from disagmoe_ds.models.hf_writer import add_tokenizer, replace_dir

    check_loadable(config, tensors)
    routers = router_modules(config, tensors) if settings.train_router else []
    adapters = {n: t for n, t in tensors.items() if is_adapter(n) or any(n.startswith(r + ".") for r in routers)}
    partial = out.with_name(f".partial-{out.name}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    lora_config(settings, adapters, base_model=base_model, routers=routers).save_pretrained(str(partial))
    state = {k: v.to(dtype).contiguous() for k, v in to_peft(adapters, routers).items()}
    save_file(state, str(partial / ADAPTER_FILE), metadata={"format": "pt"})
    add_tokenizer(partial, tokenizer_dir=tokenizer_dir, tokenizer=tokenizer)
    replace_dir(partial, out)
    return out


def experts_transposed(model_dir: str | Path) -> bool:
    """Whether the model's fused experts store ``[E, in, out]`` (GPT-OSS) rather than ``[E, out, in]``."""
    from transformers import AutoModelForCausalLM

    from disagmoe_ds.models.loading import load_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(model_dir))
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    return bool(getattr(experts[0], "is_transposed", False)) if experts else False


def merged(tensors: Mapping[str, torch.Tensor], settings: LoraSettings, *, transposed: bool) -> dict[str, torch.Tensor]:
    """The base tensors with every adapter's update added, adapters dropped (``--export-hf-merged``).
    ``transposed``: the experts store ``[E, in, out]`` (GPT-OSS)."""
    out = {n: t for n, t in tensors.items() if not is_adapter(n)}
    for name in tensors:
        module, leaf = _split(name)
        if leaf == A:
            a, b = tensors[name].float(), tensors[f"{module}.{B}"].float()
            weight = out[f"{module}.weight"]
            out[f"{module}.weight"] = (weight.float() + b @ a * settings.scaling).to(weight.dtype)
        elif leaf in EXPERT_SUFFIXES and leaf.endswith(A):
            proj = leaf[: -len(A) - 1]
            a, b = tensors[name].float(), tensors[f"{module}.{proj}_{B}"].float()
            weight = out[f"{module}.{proj}"]
            out[f"{module}.{proj}"] = weight + expert_delta(weight.float(), a, b, settings.scaling, transposed).to(
                weight.dtype
            )
    return out


# ----------------------------------------------------------------------------------------------------------------
# The PEFT model as a reference (disagmoe-verify)
# ----------------------------------------------------------------------------------------------------------------


def peft_model(model: nn.Module, settings: LoraSettings, init: Mapping[str, torch.Tensor]) -> nn.Module:
    """``model`` under PEFT with the adapters named in ``init`` (our HF names), holding ``init``'s values; the
    routers' weights trainable with ``train_router``, like ours."""
    from peft import get_peft_model

    routers = router_modules(model.config, dict(model.named_parameters())) if settings.train_router else []
    with _no_v4_renames():
        wrapped = get_peft_model(model, lora_config(settings, init))
    params = dict(wrapped.named_parameters())
    with torch.no_grad():
        for peft_name, (ours, ab, experts) in _peft_names(wrapped).items():
            value = init[ours] if experts is None else _expert_to_peft(init[ours], ab)
            params[peft_name].copy_(value)
    for peft_name, ours in ours_named(wrapped, params).items():
        if any(ours.startswith(r + ".") for r in routers) and not ours.endswith("e_score_correction_bias"):
            params[peft_name].requires_grad_(True)
    return wrapped


@contextlib.contextmanager
def _no_v4_renames() -> Iterator[None]:
    """PEFT without its transformers-v4 rename of targets (``v4_renamed``), for the reference of adapters on
    dense and shared MLPs."""
    from peft.utils import transformers_weight_conversion as conversion

    kept = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = kept


def check_adapter_export(config, settings: LoraSettings) -> None:
    """Before launch, what ``write_adapter`` would refuse after training: adapters PEFT cannot load."""
    from disagmoe_ds.models.adapters import attention_side_linears

    adapted = [name for name, group, leaf in attention_side_linears(config) if settings.adapts(group, leaf)]
    check_loadable(config, [f"{name}.{A}" for name in adapted])


def check_loadable(config, names: Any) -> None:
    """Refuse adapters (tensor names) that PEFT would not load as adapted (``v4_renamed``), naming the way out."""
    renamed = v4_renamed(config, names)
    if renamed:
        raise ConfigError(
            f"PEFT cannot load adapters on {renamed[0]} ({len(renamed)} such modules): for {config.model_type} it "
            "takes gate_proj/up_proj/down_proj targets for transformers-4 expert projections and moves them to the "
            "fused experts. Export the merged model instead (--export-hf-merged), or leave those modules out of "
            "--lora-targets (name the projections to adapt)"
        )


def v4_renamed(config, names: Any) -> list[str]:
    """The adapted modules among ``names`` that PEFT (0.21) would not load as adapted: for MoE models whose experts
    transformers 5 fused, PEFT reads any target named like a transformers-4 expert projection (``gate_proj``,
    ``up_proj``, ``down_proj``; Mixtral's ``w1``-``w3``) as one, and moves it to the fused experts at twice the rank,
    so a dense or shared MLP's adapter would be dropped on load."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    if get_checkpoint_conversion_mapping(config.model_type) is None:
        return []
    v4 = {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate"}
    return sorted({_split(n)[0] for n in names if _split(n)[1] in (A, B) and _split(_split(n)[0])[1] in v4})


def ours_named(wrapped: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Our HF name of each of PEFT's parameter names in ``tensors``."""
    adapters = _peft_names(wrapped)
    return {n: adapters[n][0] if n in adapters else _base_name(n) for n in tensors}


def to_ours(wrapped: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` named like the PEFT model's parameters (values or gradients) under our names and layouts."""
    adapters = _peft_names(wrapped)
    out = {}
    for name, value in tensors.items():
        if name not in adapters:
            out[_base_name(name)] = value
            continue
        ours, ab, experts = adapters[name]
        out[ours] = value if experts is None else _expert_from_peft(value, ab, experts)
    return out


def _base_name(peft_name: str) -> str:
    return peft_name.removeprefix(PREFIX).replace(".base_layer", "")


def _peft_names(wrapped: nn.Module) -> dict[str, tuple[str, str, int | None]]:
    """PEFT's adapter parameter names -> (our name, ``lora_A``/``lora_B``, E for expert factors else None)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    names = {}
    for module_name, module in wrapped.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = _base_name(module_name)
        for ab in (A, B):
            peft_name = f"{module_name}.{ab}.default.weight"
            if isinstance(module, ParamWrapper):
                names[peft_name] = (f"{base}.{module.parameter_name}_{ab}", ab, module.num_experts)
            else:
                names[peft_name] = (f"{base}.{ab}", ab, None)
    return names


def initial_adapters(model: nn.Module, settings: LoraSettings, *, seed: int) -> dict[str, torch.Tensor]:
    """The adapters every rank of a run with ``seed`` starts from, for the whole model under HF names (cut as one
    attention stage and one shard of all experts, from a copy of ``model``)."""
    from disagmoe_ds.models.adapters import add_adapters
    from disagmoe_ds.models.naming import attention_name_to_hf, expert_name_to_hf
    from disagmoe_ds.models.split import SplitModel

    split = SplitModel(copy.deepcopy(model), 1)
    add_adapters(split, settings, seed=seed)
    named = {attention_name_to_hf(n): p for n, p in split.attention.named_parameters()}
    named |= {expert_name_to_hf(n): p for n, p in split.shards[0].named_parameters()}
    return {n: p.detach().clone() for n, p in named.items() if is_adapter(n)}
