"""The ``"disagmoe"`` section of a ds_config is an interface, like the command line: a key is added or removed on
purpose, with these lists (the flags are frozen in test_train_args), and documented in ds_configs/README.md."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.models.lora_settings import LoraSettings
from tests.conftest import ROOT

KEYS = {
    DisagMoEConfig: {
        "attention_gpus", "ffn_gpus", "depth", "micro_batches", "expert_data_parallel", "node_dedup",
        "sequence_parallel", "tensor_parallel", "max_in_flight", "comm_timeout_s", "compile", "attention",
        "cuda_graphs", "fp8", "fp8_cast_per_call", "fp8_bf16_width", "fp8_expert_bf16_width",
        "activation_checkpointing", "selective_recompute", "recompute", "comm_stream", "transport", "capacity_factor",
        "resend", "offload", "split_backward", "zero_stage", "offload_optimizer", "cluster", "ffn_cluster", "profile",
        "lora",
        "colocated",
    },
    ColocatedConfig: {
        "world_size", "ep_size", "pp_size", "virtual_stages", "stage_layers", "transport", "micro_batches",
        "comm_timeout_s", "compile", "attention", "cuda_graphs", "fp8", "fp8_cast_per_call", "fp8_bf16_width",
        "fp8_expert_bf16_width", "activation_checkpointing", "selective_recompute", "recompute", "lora",
        "sequence_parallel", "tensor_parallel",
    },
    LoraSettings: {"rank", "alpha", "dropout", "targets", "train_router", "init_lora_weights"},
}  # fmt: skip


@pytest.mark.parametrize("section", KEYS, ids=lambda cls: cls.__name__)
def test_section_keys_are_frozen(section):
    assert {f.name for f in fields(section)} == KEYS[section]


def test_an_unknown_key_names_every_known_one():
    with pytest.raises(ConfigError) as err:
        DisagMoEConfig.from_ds_config({"disagmoe": {"attention_gpu": 2}})
    assert 'unknown key(s) in "disagmoe": attention_gpu; known: ' in str(err.value)
    assert all(key in str(err.value) for key in KEYS[DisagMoEConfig])


def _documented(heading: str) -> set[str]:
    """The keys in the first column of the tables under ``heading`` in ds_configs/README.md (up to the next heading)."""
    text = (ROOT / "ds_configs" / "README.md").read_text()
    start = next(m.end() for m in re.finditer(r"^#+ (.*)$", text, flags=re.M) if m.group(1).startswith(heading))
    end = next((m.start() for m in re.finditer(r"^#", text[start:], flags=re.M)), len(text) - start) + start
    return set(re.findall(r"^\| `(\w+)` \|", text[start:end], flags=re.M))


DOCUMENTED = {DisagMoEConfig: '`"disagmoe"`', LoraSettings: '`"lora"`', ColocatedConfig: "Co-located mode"}


@pytest.mark.parametrize("section", KEYS, ids=lambda cls: cls.__name__)
def test_every_section_key_is_documented(section):
    """ds_configs/README.md has a row for every key of each section, under that section's heading."""
    assert _documented(DOCUMENTED[section]) == KEYS[section]
