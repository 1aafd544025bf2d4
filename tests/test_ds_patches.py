"""The DeepSpeed patches (``runtime/ds_patches.py``) against the installed DeepSpeed: every internal they rely on
exists on real engines of every ZeRO stage, the table lists every attribute each patch touches, and a missing one
fails in one line that names it and the pinned version."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.runtime import ds_patches
from disagmoe_ds.runtime.deepspeed_role import GlobalGradNorm, build_engine
from tests.conftest import ROOT

# Which patches apply to an engine of each ZeRO stage, and to which of its objects.
ON_OPTIMIZER = {
    1: ("combine_zero_norm", "combine_zero_group_norms", "step_as_overflow"),
    2: ("combine_zero_norm", "combine_zero_group_norms", "step_as_overflow", "allow_backward_without_gradients"),
    3: ("combine_zero3_norm", "accumulate_across_backwards"),
}


def _engines_have_the_internals(rank: int) -> list[str]:
    """One rank: an engine per ZeRO stage, built and stepped as the runtime does; the patches each one lacks."""
    missing = []
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        ds_config = {"gradient_clipping": 1.0}
        engine = build_engine(
            module,
            ds_config,
            micro_batches=1,
            micro_batch_size=1,
            data_parallel_group=dist.group.WORLD,
            zero_stage=stage,
        )  # applies allow_backward_without_gradients (ZeRO-2), barriers_within and accumulate_across_backwards (3)
        GlobalGradNorm(1).install(engine)  # one of the norm patches
        engine.backward(engine.module(torch.randn(2, 8)).square().sum())
        engine.step()
        targets = [(p, engine.optimizer) for p in ON_OPTIMIZER.get(stage, ())]
        targets += [("replace_fp32_clipping", engine)] if stage == 0 else []
        for patch, obj in targets:
            if any(not hasattr(obj, name) for name in ds_patches.INTERNALS[patch]):
                missing.append(f"stage {stage}: {patch}")
    return missing


def test_every_internal_exists_on_real_engines_of_every_stage():
    assert run_ranks(_engines_have_the_internals, 1) == [[]]


def test_the_table_lists_every_attribute_each_patch_touches():
    """A patch that reads or replaces an attribute of its DeepSpeed object not in ``INTERNALS`` fails here."""
    for name, attrs in ds_patches.INTERNALS.items():
        fn = getattr(ds_patches, name)
        tree = ast.parse(inspect.getsource(getattr(fn, "__wrapped__", fn)))
        params = [a.arg for a in tree.body[0].args.args]  # type: ignore[attr-defined]
        owner = params[0] if params[0] in ("optimizer", "engine") else "deepspeed.comm"
        touched = {
            node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and ast.unparse(node.value) == owner
        }
        touched |= {  # setattr(optimizer, "overflow", ...)
            node.args[1].value
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and ast.unparse(node.args[0]) == owner
        }
        assert touched == set(attrs), name


def test_a_missing_internal_is_one_line_naming_it_and_the_pinned_version():
    class Optimizer:  # a DeepSpeed whose ZeRO optimizer renamed its norm
        pass

    with pytest.raises(ds_patches.DeepSpeedInternalsError) as err:
        ds_patches.combine_zero_norm(Optimizer(), lambda norm: norm)
    message = str(err.value)
    assert "Optimizer has no scaled_global_norm" in message and "\n" not in message
    assert f"install deepspeed=={ds_patches.PINNED}" in message


def test_the_pinned_version_is_what_setup_installs():
    assert f'"deepspeed=={ds_patches.PINNED}"' in (ROOT / "setup.py").read_text()
