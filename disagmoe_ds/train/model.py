"""The HF model a rank cuts its role from: freshly initialised or pretrained, with parts frozen on request.

The model is built on the meta device either way, so no rank ever holds it whole: a rank allocates only the parts
it cuts, then initialises them or, with ``--init-from``, reads their pretrained values from the directory's
safetensors (``models.partial_load``; ``pytorch_model.bin`` and quantized checkpoints are still loaded whole).

Freezing happens on the whole (meta) model before ``build_rank`` cuts it: the attention stages and expert shards
keep ``requires_grad`` (allocating a part keeps it too), and each role engine's DeepSpeed optimizer receives only
the trainable parameters. Gradients still flow *through* frozen modules (the router's input is trainable), only
their weights stay put.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.models.families import family_of, is_moe_layer, mixer_attr, router_of
from disagmoe_ds.models.fp8_base import check_fp8_base, fp8_block_size, keep_base_fp8
from disagmoe_ds.models.hf_model import causal_lm
from disagmoe_ds.models.loading import build_meta_model, load_config
from disagmoe_ds.models.partial_load import PretrainedWeights, check_pretrained, model_to_cut
from disagmoe_ds.models.peft_format import check_adapter_export
from disagmoe_ds.train.args import TrainArgs


@dataclass(frozen=True)
class Frozen:
    """How many parameters ``freeze`` fixed, for the start banner."""

    router: int
    attention: int


@dataclass(frozen=True)
class TrainModel:
    """What every rank cuts its parts from (``train.modes.build``)."""

    model: nn.Module  # on the meta device (whole only for a pytorch_model.bin or quantized --init-from)
    weights: Path | None  # the directory whose safetensors fill a meta model's parts; None: initialise them
    frozen: Frozen


def load_train_model(args: TrainArgs) -> TrainModel:
    """``--model``'s config on the meta device, and with ``--init-from`` the directory holding its weights.

    ``build_rank`` allocates only the parts a rank owns, then fills them with the pretrained values (``--init-from``)
    or initialises them (HF's ``_init_weights``). A ``--model`` directory that holds weights is still initialised
    fresh: pretraining starts from scratch unless ``--init-from`` says otherwise.
    """
    if args.pretrained:
        model, weights = model_to_cut(args.model, dtype=args.torch_dtype, require_weights=True)
    else:
        model, weights = build_meta_model(args.model, dtype=args.torch_dtype), None
    return TrainModel(model, weights, freeze(model, router=args.freeze_router, attention=args.freeze_attention))


def check_train_model(args: TrainArgs, config) -> None:
    """Before any rank starts: with ``--init-from``, the directory holds weights and every tensor of the model; LoRA
    adapts pretrained weights, and an adapter directory it exports is one PEFT loads."""
    if args.pretrained:
        check_pretrained(args.model, dtype=args.torch_dtype)
    lora = args.cfg.lora
    if lora is None:
        return
    if not args.pretrained:
        raise ConfigError(
            f"LoRA trains adapters over pretrained weights, and {args.model} is trained from a fresh init (its "
            f"adapters would have no base to load onto): pass --init-from HF_DIR, or drop --lora-rank to train "
            f"every weight"
        )
    if fp8_block_size(load_config(args.model)) is not None:  # the base stays FP8 (``fp8_base``)
        check_fp8_base(args.cfg.fp8)
        meta = build_meta_model(args.model, dtype=args.torch_dtype)
        keep_base_fp8(meta, PretrainedWeights(args.model, meta))  # what cannot stay FP8 is refused here, in one line
    if args.export_hf is not None:
        check_adapter_export(config, lora)


def freeze(model: nn.Module, *, router: bool, attention: bool) -> Frozen:
    """Set ``requires_grad=False`` on every MoE router (``router``) and every token mixer (attention block) and its
    input norm (``attention``); returns the number of parameters frozen in each."""
    model = causal_lm(model)
    family = family_of(model.config)
    counts = {"router": 0, "attention": 0}
    for layer in model.model.layers:
        parts = []
        if router and is_moe_layer(layer):
            parts.append(("router", router_of(family, layer)))
        if attention:
            parts += [("attention", getattr(layer, mixer_attr(layer))), ("attention", layer.input_layernorm)]
        for kind, module in parts:
            for param in module.parameters():
                param.requires_grad_(False)
                counts[kind] += param.numel()
    return Frozen(**counts)
