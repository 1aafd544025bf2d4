"""What the user hands the planner, checked once: JSON files and command-line counts, each refused with a
``ConfigError`` that names the flag (pure Python).

>>> check_at_least_one({"--seq-len": 4096, "--global-batch-size": None})
>>> check_at_least_one({"--repeats": 0})
Traceback (most recent call last):
...
disagmoe_ds.errors.ConfigError: --repeats must be at least 1, got 0
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from disagmoe_ds.errors import ConfigError


def read_json(path: Path, flag: str) -> Any:
    """The JSON value in ``path`` (which the caller has checked exists); ``flag`` names the file in the error."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{flag} {path}: not valid JSON ({err})") from err


def check_at_least_one(counts: Mapping[str, int | None]) -> None:
    """Refuse the first count below 1, in order; None (a flag left unset) passes."""
    for flag, value in counts.items():
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")


def description(doc: str | None) -> str:
    """A subcommand's ``--help`` description: its module docstring's first paragraph whole (argparse re-wraps it),
    not its first line, which stops mid-sentence."""
    return " ".join((doc or "").split("\n\n")[0].split())
