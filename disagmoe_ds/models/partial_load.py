"""Fill the parts a rank cut from a meta model with pretrained values, reading only the tensors the rank holds.

The weights are the HF directory's safetensors (``model.safetensors`` or a sharded ``model.safetensors.index.json``),
memory-mapped by ``safe_open``. An attention stage reads its tensors whole. An expert shard reads only its experts
``[first_expert, first_expert + num_local)``: those rows of a tensor the checkpoint stores fused (GPT-OSS), or only
those experts' tensors where it stores one tensor per expert (every other family).

Checkpoint keys map to the model's in-memory names through transformers' own conversion mapping, the one
``from_pretrained`` applies (``get_model_conversion_mapping``, ``rename_source_key``): its renamings (Mixtral's
``block_sparse_moe`` -> ``mlp``) and its converters, whose operations fuse the per-expert tensors (``MergeModulelist``
stacks the experts along dim 0, ``Concatenate`` puts gate before up along dim 1). Both act on each expert alone, so
running them on a rank's experts gives exactly its slice of the fused tensor; an expert converter with any other
operation is refused, not approximated. Values are cast to the meta model's dtype of each tensor, as
``from_pretrained`` casts them (DeepSeek's router stays fp32 in a bf16 model).

A checkpoint in FP8 with block scales (DeepSeek-V3's) is read so too (``fp8_base``): a weight is dequantized exactly
on reading, or, held as frozen FP8 buffers (a LoRA run's base), read as its e4m3 values and scales.
``pytorch_model.bin`` checkpoints (no per-tensor reader) and otherwise quantized ones (a quantizer converts them while
loading) are still loaded whole by ``from_pretrained`` in every rank (``model_to_cut``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.fp8.blocks import dequantize_blocks
from disagmoe_ds.fp8.frozen import SCALE_SUFFIX, held_weights
from disagmoe_ds.models.attention_part import AttentionPart
from disagmoe_ds.models.fp8_base import fp8_block_size
from disagmoe_ds.models.hf_model import causal_lm
from disagmoe_ds.models.loading import (
    build_meta_model,
    check_weights,
    fill_token_tables,
    has_weights,
    load_config,
    load_model,
    shared_parameters,
)
from disagmoe_ds.models.naming import attention_name_to_hf, expert_name_to_hf
from disagmoe_ds.models.parts import ExpertStage

SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")  # from_pretrained's order of preference
HF_INITIALIZED = "_is_hf_initialized"  # transformers' mark on a parameter its loading or init has written

Read = Callable[..., torch.Tensor]  # read(key, rows: range | None = None): the tensor, or only its rows (dim 0)


def reads_partially(path: str | Path) -> bool:
    """Ranks can read only their own tensors: the weights are safetensors, not quantized or in FP8 blocks."""
    path = Path(path)
    safetensors = any((path / name).is_file() for name in SAFETENSORS)
    config = load_config(path)
    return safetensors and (getattr(config, "quantization_config", None) is None or fp8_block_size(config) is not None)


def model_to_cut(
    path: str | Path, *, dtype: torch.dtype = torch.float32, require_weights: bool = False
) -> tuple[nn.Module, Path | None]:
    """The model a rank cuts its parts from, and the directory whose weights fill them (``place``).

    Safetensors: the meta model and ``path``; each rank reads only its parts. ``pytorch_model.bin`` or a quantized
    checkpoint: the whole model, loaded by ``from_pretrained`` in every rank, and None. No weights: the meta model
    and None (the parts are initialised fresh), or the ``check_weights`` error with ``require_weights``.
    """
    path = Path(path)
    if not has_weights(path) and not require_weights:
        return build_meta_model(path, dtype=dtype), None
    check_weights(path)
    if not reads_partially(path):
        return load_model(path, dtype=dtype), None
    return build_meta_model(path, dtype=dtype), path


def rank_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    model: nn.Module | None = None,
    weights: str | Path | None = None,
) -> tuple[nn.Module, PretrainedWeights | None]:
    """What a rank cuts its parts from: ``model``, else ``model_to_cut(model_dir)``; and for a meta model, the
    reader of the weights that fill its parts (None: they are initialised fresh)."""
    if model is None:
        model, weights = model_to_cut(model_dir, dtype=dtype)
    on_meta = next(model.parameters()).is_meta
    return model, PretrainedWeights(weights, model) if on_meta and weights is not None else None


def check_pretrained(path: str | Path, *, dtype: torch.dtype = torch.float32) -> None:
    """Before any rank starts: ``path`` holds weights and, where ranks read them partially, every tensor of the model
    (a one-line ``CheckpointError`` naming the first one missing). Reads the index or the files' headers only."""
    check_weights(path)
    if reads_partially(path):
        PretrainedWeights(path, build_meta_model(path, dtype=dtype)).check()


@dataclass(frozen=True)
class _Plain:
    """An in-memory tensor stored as one checkpoint tensor (renamed at most)."""

    key: str


@dataclass
class _Converted:
    """An in-memory tensor that a transformers converter builds from per-expert checkpoint tensors."""

    converter: WeightConverter
    keys: dict[str, dict[int, str]] = field(default_factory=dict)  # source pattern -> expert -> checkpoint key


class PretrainedWeights:
    """The safetensors of an HF directory, indexed by the in-memory names of the model built from its config."""

    def __init__(self, path: str | Path, model: nn.Module):
        model = causal_lm(model)
        self.path = Path(path)
        self._files = _weight_files(self.path)
        state = model.state_dict()
        self._shapes = {name: tensor.shape for name, tensor in state.items()}
        self._sources = _sources(model, state, self._files)
        # save_pretrained writes a tied pair once; like tie_weights, the first name (the embedding) gives the value.
        self._ties = {name: group for group in shared_parameters(model) for name in group}
        self.block = fp8_block_size(model.config)  # an FP8 checkpoint's block scales' shape, else None

    def quantized(self, name: str) -> bool:
        """Whether the checkpoint stores in-memory tensor ``name`` in FP8 (each of its tensors with block scales)."""
        source = self._source(name) if self.block is not None else None
        if source is None:
            return False
        keys = [source.key] if isinstance(source, _Plain) else [k for ks in source.keys.values() for k in ks.values()]
        return all(key + SCALE_SUFFIX in self._files for key in keys)

    def check(self) -> None:
        """Every parameter and persistent buffer of the model has its tensors in the checkpoint."""
        for name, shape in self._shapes.items():
            source = self._source(name)
            if isinstance(source, _Converted):
                self._expert_keys(name, source, range(shape[0]))

    def fill(self, stage: nn.Module) -> None:
        """Copy the pretrained values into ``stage`` (an ``AttentionStage`` or ``ExpertStage`` allocated by
        ``place``): its parameters and persistent buffers, each read once."""
        to_hf, experts = _hf_names(stage)
        done: set[int] = set()
        with _reader(self.path, self._files, self.block) as read, torch.no_grad():
            for name, held in held_weights(stage).items():  # frozen FP8 (``fp8_base``): values and scales as stored
                for tensor, suffix in ((held.data, ""), (held.scale_inv, SCALE_SUFFIX)):
                    value = self._value(read, to_hf(name), experts, suffix, raw=True)
                    self._copy(tensor, value, to_hf(name) + suffix)
            for name, tensor in stage.state_dict(keep_vars=True).items():
                if id(tensor) in done:  # a tied parameter under its second name
                    continue
                hf_name = to_hf(name)
                self._copy(tensor, self._value(read, hf_name, experts), hf_name)
                done.add(id(tensor))

    def _copy(self, tensor: torch.Tensor, value: torch.Tensor, hf_name: str) -> None:
        if value.shape != tensor.shape:
            raise CheckpointError(
                f"{hf_name} in {self.path} has shape {tuple(value.shape)} where the model built from its "
                f"config.json has {tuple(tensor.shape)}"
            )
        tensor.copy_(value)

    def _value(self, read: Read, name: str, experts: range | None, suffix: str = "", raw: bool = False) -> torch.Tensor:
        """In-memory tensor ``name``, or only the rows of ``experts`` (an expert shard's slice); an FP8 weight
        dequantized, or with ``raw`` as stored (``suffix``: the checkpoint's tensors of that suffix, its scales)."""
        source = self._source(name)
        if isinstance(source, _Plain):
            return read(source.key + suffix, experts, raw=raw)
        converter = source.converter
        if experts is not None:
            _check_per_expert(converter, name)
        keys = self._expert_keys(name, source, range(self._shapes[name][0]) if experts is None else experts)
        # a tensor or a list of them per pattern, as transformers' operations take and give them (typed dict[str, Any])
        tensors: dict[str, Any] = {
            pattern: [read(key + suffix, raw=raw) for key in pattern_keys] for pattern, pattern_keys in keys.items()
        }
        for op in converter.operations:
            tensors = op.convert(
                tensors,
                source_patterns=converter.source_patterns,
                target_patterns=converter.target_patterns,
                full_layer_name=name,
            )
        (value,) = tensors.values()
        if not isinstance(value, torch.Tensor):  # the converter's last operation merges the experts into one
            raise CheckpointError(f"transformers' conversion of {name} left {len(value)} tensors, not one")
        return value

    def _source(self, name: str) -> _Plain | _Converted:
        for candidate in self._ties.get(name, [name]):
            if candidate in self._sources:
                return self._sources[candidate]
        raise CheckpointError(f"{self.path} has no tensor for {name}, which the model built from its config.json has")

    def _expert_keys(self, name: str, source: _Converted, experts: range) -> dict[str, list[str]]:
        """The checkpoint keys of ``experts`` per source pattern, in the converter's order."""
        keys = {}
        for pattern in source.converter.source_patterns:
            present = source.keys.get(pattern, {})
            missing = [e for e in experts if e not in present]
            if missing:
                key = _key_of_expert(pattern, missing[0], present)
                raise CheckpointError(f"{self.path} has no tensor {key} (expert {missing[0]} of {name})")
            keys[pattern] = [present[e] for e in experts]
        return keys


def _weight_files(path: Path) -> dict[str, str]:
    """Checkpoint key -> the safetensors file holding it."""
    if (path / SAFETENSORS[0]).is_file():
        with _open(path / SAFETENSORS[0]) as handle:
            return dict.fromkeys(handle.keys(), SAFETENSORS[0])
    return json.loads((path / SAFETENSORS[1]).read_text())["weight_map"]


def _open(file: Path):
    return safe_open(file, framework="pt", device="cpu")


def _sources(
    model: PreTrainedModel, expected: dict[str, torch.Tensor], files: dict[str, str]
) -> dict[str, _Plain | _Converted]:
    """In-memory name -> its checkpoint tensors, renamed and grouped as ``from_pretrained`` does it
    (``convert_and_load_state_dict_in_model``); checkpoint tensors the model does not have are skipped, as there."""
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    sources: dict[str, _Plain | _Converted] = {}
    for key in sorted(files, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if name not in expected and key in expected:  # a key the model has as it is keeps its name
            name, pattern = key, None
        if name not in expected:
            continue
        if pattern is None:
            sources.setdefault(name, _Plain(key))
        else:
            source = sources.setdefault(name, _Converted(by_pattern[pattern]))
            if isinstance(source, _Plain):
                raise CheckpointError(f"checkpoint tensors {source.key} and {key} both load into {name}")
            source.keys.setdefault(pattern, {})[_expert_of(pattern, key)] = key
    return sources


def _star(pattern: str) -> re.Pattern:
    r"""A converter's source pattern (``mlp.experts.*.up_proj.weight``; DeepSeek-V4's ``\.experts.*.w1.weight``)
    with the expert number captured. transformers reads the patterns as regular expressions (``*`` as ``.*``), and
    so does this (``*`` as the number)."""
    return re.compile(pattern.replace("*", r"(\d+)"))


def _expert_of(pattern: str, key: str) -> int:
    return int(_expert_match(pattern, key).group(1))


def _expert_match(pattern: str, key: str) -> re.Match:
    """Where checkpoint tensor ``key`` names its expert (``_star``)."""
    match = _star(pattern).search(key)
    if match is None:
        raise CheckpointError(f"cannot tell which expert checkpoint tensor {key} holds (pattern {pattern})")
    return match


def _key_of_expert(pattern: str, expert: int, present: dict[int, str]) -> str:
    """The key expert ``expert`` would have: another expert's key of the same tensor with the number replaced."""
    if not present:
        return pattern.replace("*", str(expert))
    key = next(iter(present.values()))
    match = _expert_match(pattern, key)
    return key[: match.start(1)] + str(expert) + key[match.end(1) :]


def _check_per_expert(converter: WeightConverter, name: str) -> None:
    """Only operations that act on each expert alone commute with reading a slice of the experts."""
    for op in converter.operations:
        stacks_experts = isinstance(op, MergeModulelist) and op.dim == 0
        joins_within_experts = isinstance(op, Concatenate) and op.dim != 0
        if not (stacks_experts or joins_within_experts):
            raise CheckpointError(
                f"cannot read a slice of the experts of {name}: transformers converts them with "
                f"{type(op).__name__}, which may mix experts"
            )


def _hf_names(stage: nn.Module) -> tuple[Callable[[str], str], range | None]:
    """How the stage's names map to HF's, and the experts (dim-0 rows of HF's fused tensors) an expert stage holds."""
    if isinstance(stage, ExpertStage):
        return expert_name_to_hf, range(stage.first_expert, stage.first_expert + stage.num_local)
    return (str, None) if isinstance(stage, PreTrainedModel) else (attention_name_to_hf, None)  # a whole model: HF's


@contextmanager
def _reader(path: Path, files: dict[str, str], block: tuple[int, int] | None = None) -> Iterator[Read]:
    """``read(key, rows=None, raw=False)``: a checkpoint tensor, or only its rows; each file opened (memory-mapped)
    once. An FP8 tensor of a checkpoint in ``block`` scales is dequantized (float32) unless ``raw``."""
    with ExitStack() as stack:
        handles = {}

        def stored(key: str, rows: range | None) -> torch.Tensor:
            file = files[key]
            if file not in handles:
                handles[file] = stack.enter_context(_open(path / file))
            if rows is None:
                return handles[file].get_tensor(key)
            return handles[file].get_slice(key)[rows.start : rows.stop]

        def read(key: str, rows: range | None = None, raw: bool = False) -> torch.Tensor:
            if raw or block is None or key + SCALE_SUFFIX not in files:
                return stored(key, rows)
            return dequantize_blocks(stored(key, rows), stored(key + SCALE_SUFFIX, rows), block)

        yield read


def place(
    stage: nn.Module,
    model: nn.Module,
    device: torch.device,
    *,
    seed: int = 0,
    weights: PretrainedWeights | None = None,
) -> None:
    """Put a part cut from ``model`` on ``device``: moved there, or, cut from a meta model, allocated there and
    filled with the pretrained values of ``weights`` or initialised with HF's own ``_init_weights`` from ``seed``.

    Replicas of the same parameters may draw different values here; DeepSpeed broadcasts each data-parallel
    group's rank-0 copy when the engine is built, so they start identical.
    """
    tensors = list(chain(stage.parameters(), stage.buffers()))
    if not tensors:  # a pipeline stage's experts where its layers are dense
        return
    if not tensors[0].is_meta:  # an FP8 base's expert stage: buffers only
        stage.to(device)
        return
    _allocate(stage, device)
    if weights is not None:
        weights.fill(stage)
    else:
        _initialise(stage, model, seed)
    # Rotary embeddings' inv_freq buffers are computed in __init__, neither initialised nor loaded: made again (the
    # model's, and those DeepSeek-V4's compressors and indexers hold).
    rotaries = [name for name, module in stage.named_modules() if name.rpartition(".")[2] == "rotary_emb"]
    for name in rotaries:
        owner, _, attr = name.rpartition(".")
        parent = stage.get_submodule(owner)
        with torch.device(device):
            setattr(parent, attr, type(getattr(parent, attr))(config=model.config))


def _allocate(stage: nn.Module, device: torch.device) -> None:
    """``to_empty``, keeping tied parameters (one object under several names) tied: ``to_empty`` gives every
    module a new parameter of its own."""
    tied = shared_parameters(stage)
    stage.to_empty(device=device)
    for names in tied:
        param = stage.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(stage.get_submodule(owner), attr, param)


def _initialise(stage: nn.Module, model: nn.Module, seed: int) -> None:
    model = causal_lm(model)
    torch.manual_seed(seed)
    for param in stage.parameters():
        if getattr(param, HF_INITIALIZED, False):
            setattr(param, HF_INITIALIZED, False)  # set while building on meta, where nothing was written
    for module in stage.modules():
        model._init_weights(module)
    parts = {part.layer_idx: part for part in stage.modules() if isinstance(part, AttentionPart)}
    fill_token_tables(parts, model.config)  # as load_model fills a generated model's
