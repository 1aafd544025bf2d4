"""``DisagMoEConfig``: the disaggregated mode's section, composed of the typed sections, with the rules that span
them, and reading a ds_config file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from disagmoe_ds.capabilities.rules import check
from disagmoe_ds.config.levers import job_of
from disagmoe_ds.config.sections import (
    SECTION,
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
        check(job_of(None, self))  # the levers the section turns on beside each other (capabilities.rules)

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


def load_ds_config(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a dict, from a JSON file or an in-memory dict (copied)."""
    if isinstance(path_or_dict, dict):
        return json.loads(json.dumps(path_or_dict))
    return read_json_object(path_or_dict, what="DeepSpeed config", fix="see ds_configs/ for examples")
