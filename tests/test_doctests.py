"""Every ``>>>`` example in the package runs as written (``doctest``): each module that holds one is found by its text,
so a new example runs without being listed here."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _modules_with_examples() -> list[str]:
    modules = []
    for path in sorted((ROOT / "disagmoe_ds").rglob("*.py")):
        if ">>>" in path.read_text(encoding="utf-8"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


MODULES = _modules_with_examples()


def test_the_examples_are_found() -> None:
    assert {"disagmoe_ds.layout", "disagmoe_ds.schedule", "disagmoe_ds.planner.runtime_costs"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_the_examples_run(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0, f"{module} holds '>>>' outside any example doctest finds"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {module} failed (printed above)"
