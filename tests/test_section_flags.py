"""A section key is declared once as a flag: run_pretrain.py's, disagmoe-verify's, the co-located verify's,
disagmoe-convert's and bench_e2e.py's flags for ``"disagmoe"`` keys are made from ``config.SECTION_FLAGS``, so the
same key has the same flag, type and meaning everywhere; only a CLI's default may differ, where the table says so
(or a flag a CLI requires has none)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import fields

import pytest

from disagmoe_ds.afpipe import verify
from disagmoe_ds.colocated import verify as colocated_verify
from disagmoe_ds.config import CLIS, SECTION_FLAGS, DisagMoEConfig, flag_of
from disagmoe_ds.convert import _colocated_cfg, _relayout_cfg
from disagmoe_ds.convert import build_parser as convert_parser
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.train.flags import build_parser as pretrain_parser
from tests.conftest import ROOT

KEYS = {f.name for f in fields(DisagMoEConfig)}


def _bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "bench" / "bench_e2e.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = module  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


PARSERS = {  # the CLIs that make their section flags from the table, by the name the table's defaults use
    "run_pretrain": lambda: pretrain_parser(
        description="", default_model=ROOT, default_ds_config=ROOT, default_cache=ROOT
    ),
    "verify": verify.build_parser,
    "colocated_verify": colocated_verify.build_parser,
    "convert": convert_parser,
    "bench": lambda: _bench().build_parser(gpus=0),
}


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _actions(sub)
        else:
            found.append(action)
    return found


def _section_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's actions for section keys: by destination, or by a table flag's name."""
    names = {spec.flag(key): key for key, spec in SECTION_FLAGS.items()} | {flag_of(key): key for key in KEYS}
    out = {}
    for action in _actions(parser):
        key = (
            action.dest if action.dest in KEYS else next((names[o] for o in action.option_strings if o in names), None)
        )
        if key is not None:
            out[key] = action
    return out


# flags a CLI leaves without a default and asks for where it needs them (relayout: a disaggregated target's ranks)
WITHOUT_DEFAULT = {"convert": ("attention_gpus", "ffn_gpus")}


def _meaning(action: argparse.Action) -> tuple:
    return (tuple(action.option_strings), action.dest, action.type, action.nargs, action.choices, type(action).__name__)


@pytest.mark.parametrize("cli", PARSERS)
def test_every_section_flag_comes_from_the_table(cli):
    section = _section_actions(PARSERS[cli]())
    assert section, f"{cli} has no section flags"
    for key, action in section.items():
        assert getattr(action, "section_key", None) == key, f"{cli}: {action.option_strings} is declared by hand"
        spec = SECTION_FLAGS[key]
        assert action.option_strings == [spec.flag(key)] and action.help.startswith(spec.help)
        expected = spec.defaults.get(cli, None if cli == "run_pretrain" or spec.per_side else _default(key))
        expected = None if action.required or action.dest in WITHOUT_DEFAULT.get(cli, ()) else expected
        assert action.default == (False if spec.type is None and cli != "run_pretrain" else expected), (cli, key)


def _default(key: str):
    return next(f.default for f in fields(DisagMoEConfig) if f.name == key)


def test_the_same_key_means_the_same_in_every_cli():
    by_cli = {cli: _section_actions(make()) for cli, make in PARSERS.items()}
    assert set(by_cli["run_pretrain"]) <= set(by_cli["verify"])  # verify takes every layout key run_pretrain does
    for key in SECTION_FLAGS:
        meanings = {cli: _meaning(actions[key]) for cli, actions in by_cli.items() if key in actions}
        assert meanings, f"{key}: in the table but no CLI's flag"
        assert len(set(meanings.values())) == 1, (key, meanings)
    # run_pretrain.py overrides the ds_config (its flags default to None: the section's value stays); verify builds a
    # config from its flags, with the section's defaults except where the table says (its micro-batches: 2).
    assert {a.default for a in by_cli["run_pretrain"].values()} == {None}
    assert by_cli["verify"]["micro_batches"].default == 2 and by_cli["verify"]["depth"].default == 1
    assert set(CLIS) == set(PARSERS)


def test_disagmoe_convert_requires_the_target_ranks():
    """disagmoe-convert's layout flags come from the table too; hf-to-disagmoe's target rank counts have no default,
    and a relayout to a disaggregated layout needs both (a co-located target takes --world-size instead)."""
    commands = next(a for a in convert_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    to_ds, relayout = (_section_actions(commands[name]) for name in ("hf-to-disagmoe", "relayout"))
    assert all(to_ds[key].required for key in ("attention_gpus", "ffn_gpus"))
    assert not to_ds["depth"].required and to_ds["depth"].default == 1
    assert not any(relayout[key].required for key in ("attention_gpus", "ffn_gpus"))
    args = commands["relayout"].parse_args(["--ckpt", "c", "--model", "m", "--out", "o", "--ffn-gpus", "2"])
    with pytest.raises(ConfigError, match="relayout to a disaggregated layout needs --attention-gpus"):
        _relayout_cfg(args, None)
    colocated = commands["relayout"].parse_args(["--ckpt", "c", "--model", "m", "--out", "o", "--mode", "colocated"])
    with pytest.raises(ConfigError, match="relayout --mode colocated needs --world-size"):
        _colocated_cfg(colocated)


def test_the_flags_give_the_sections_values():
    a = verify.parse_args(["--offload", "0.5", "1", "--zero-stage", "1", "3", "--comm-timeout", "20", "--resend"])
    cfg = a.cfg
    assert cfg.offload == {"attention": 0.5, "ffn": 1.0} and cfg.zero_stage == {"attention": 1, "ffn": 3}
    assert (cfg.comm_timeout_s, cfg.resend, cfg.micro_batches, cfg.transport) == (20.0, True, 2, "auto")
    assert verify.parse_args([]).cfg.offload == {} and verify.parse_args([]).cfg.zero_stage == {}
    assert colocated_verify.parse_args(["--micro-batches", "3"]).cfg.micro_batches == 3
    bench = _bench().parse_args(["--device", "cpu", "--world-size", "4", "--split-backward", "--offload", "0", "0.5"])
    assert (bench.attention_gpus, bench.ffn_gpus, bench.split_backward, bench.offload) == (2, 2, True, [0.0, 0.5])
