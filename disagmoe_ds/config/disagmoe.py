"""``DisagMoEConfig``: the disaggregated mode's section, composed of the typed sections, with the rules that span
them, and reading a ds_config file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from disagmoe_ds.config.sections import (
    SECTION,
    SIDES,
    Accumulation,
    Colocation,
    CostModel,
    Exchange,
    FineTuning,
    Kernels,
    LayoutCounts,
    MemoryLevers,
    Pipeline,
    Watchdog,
    ZeroPerSide,
)
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.jsonfile import read_json_object


# Bases in reverse of the order their keys are listed in (dataclasses collect fields from the last base first).
@dataclass(frozen=True, kw_only=True)
class DisagMoEConfig(
    Colocation,
    FineTuning,
    CostModel,
    ZeroPerSide,
    MemoryLevers,
    Kernels,
    Exchange,
    Watchdog,
    Pipeline,
    Accumulation,
    LayoutCounts,
):
    """The disaggregated layout and pipeline settings: the ``"disagmoe"`` section, its keys grouped by the typed
    sections it is composed of (their docstrings describe the keys)."""

    def _check(self) -> None:
        if self.cuda_graphs:
            _check_graphable(self)

    @classmethod
    def from_ds_config(cls, ds_config: dict[str, Any], overrides: dict[str, Any] | None = None) -> DisagMoEConfig:
        section = dict(ds_config.get(SECTION, {}))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f'unknown key(s) in "{SECTION}": {", ".join(unknown)}; known: {", ".join(sorted(known))}')
        section.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls(**section)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_graphable(cfg: DisagMoEConfig) -> None:
    """Refuse what cannot run inside a captured graph: recomputation and offload move or rebuild a part's saved
    tensors, and the split backward runs a part's backward in two halves, where a graph replays it whole."""
    refused = {
        "activation_checkpointing": cfg.activation_checkpointing,
        "selective_recompute": cfg.selective_recompute,
        "offload": any(cfg.offload_share(side) > 0 for side in SIDES),
        "split_backward": cfg.split_backward,
        "sequence_parallel": cfg.sequence_parallel > 1,  # the head takes the slice's shifted labels
        "tensor_parallel": cfg.tensor_parallel > 1,
    }
    chosen = [f'"{SECTION}.{name}"' for name, on in refused.items() if on]
    if chosen:
        raise ConfigError(
            f'"{SECTION}.cuda_graphs" does not work with {", ".join(chosen)}: a graph replays a part\'s forward and '
            "backward whole, with its activations in a pool of its own; turn one of them off"
        )


def load_ds_config(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a dict, from a JSON file or an in-memory dict (copied)."""
    if isinstance(path_or_dict, dict):
        return json.loads(json.dumps(path_or_dict))
    return read_json_object(path_or_dict, what="DeepSpeed config", fix="see ds_configs/ for examples")
