"""Shared fixtures: tiny HF MoE checkpoints written by save_pretrained, one per family."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from disagmoe_ds.capabilities.facts import FACTS
from disagmoe_ds.launch.local import PORT_RANGE_ENV
from disagmoe_ds.models import expert_shard
from disagmoe_ds.models.loading import fill_token_tables

ROOT = Path(__file__).resolve().parent.parent

# Under pytest-xdist (the README's `-n 2`) each worker is a process of its own: "gw0", "gw1", ...
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    # Rendezvous ports (free_port) from a range of this worker's own, below the kernel's ephemeral ports
    # (32768 and up) and clear of 29500+ (the launchers' default): two workers' jobs never pick the same port.
    # Inherited by the subprocesses the tests start (run_pretrain.py picks its own port the same way).
    _span = 9000 // _workers
    _low = 20000 + int(XDIST_WORKER.removeprefix("gw")) * _span
    os.environ[PORT_RANGE_ENV] = f"{_low}-{_low + _span - 1}"
    # The workers split the cores, as ranks do (train.job): intra-op pools of 2 threads each on 2 shared cores
    # only spin against each other.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
TINY_FAMILIES = tuple(facts.tiny for facts in FACTS.values())  # hf_models/tiny-<family>, one per family


# The families added with issue 29 run their multi-rank checks (runtime parity, HF round trip, fine-tune resume) in
# CI for one or two of them; the rest run with DISAGMOE_ALL_FAMILIES=1 (about 2 minutes more on 2 cores).
ALL_FAMILIES = os.environ.get("DISAGMOE_ALL_FAMILIES") == "1"


def all_families_only(*values: object) -> object:
    """A parametrize case that runs only with ``DISAGMOE_ALL_FAMILIES=1``."""
    return pytest.param(
        *values, marks=pytest.mark.skipif(not ALL_FAMILIES, reason="more families: set DISAGMOE_ALL_FAMILIES=1")
    )


def write_tiny_checkpoint(family: str, out_dir: Path, seed: int = 0, max_shard_size: str = "50GB", **overrides) -> Path:
    """Random tiny weights for ``hf_models/tiny-<family>`` (config fields overridden by ``overrides``), saved in
    the Hub layout by ``save_pretrained`` (sharded, with an index, under ``max_shard_size``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{family}")
    for key, value in overrides.items():  # set, not passed: from_pretrained drops keys the config class lacks
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buf in [*model.named_buffers(), *model.named_parameters()]:  # ERNIE's is a frozen parameter
            if name.endswith("e_score_correction_bias"):  # exercise DeepSeek-V3's biased top-k choice
                buf.copy_(torch.randn_like(buf) * 0.05)
    fill_token_tables(model.model.layers, model.config)  # DeepSeek-V4's hash routing (HF's init: all zeros)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    return out_dir


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family) -> Path`` of a saved tiny model, written once per session."""
    cache: dict[tuple, Path] = {}

    def get(family: str, **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = write_tiny_checkpoint(family, tmp_path_factory.mktemp(f"tiny-{family}"), **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tok_cache(tmp_path_factory) -> Path:
    """The tokenizer cache of every run_pretrain.py run of the session (``--tokenizer-cache``): each vocabulary is
    trained on the bundled corpus once. Under xdist the workers share it (the run's common temporary directory):
    a tokenizer is trained into a temporary file and renamed into place, so a concurrent reader never sees half."""
    if XDIST_WORKER:
        shared = tmp_path_factory.getbasetemp().parent / "tokenizers"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture
def pairs_log(monkeypatch, tmp_path):
    """Every rank (forked) appends the routed pairs of each expert forward it runs to ``rank<r>.txt``."""
    forward = expert_shard.ExpertShard.forward

    def logged(self, x_RH, local_idx_RK, w_RK, num_pairs=None, bounded=False):
        if x_RH.requires_grad and dist.is_initialized():
            pairs = int((local_idx_RK < self.num_local).sum())
            with open(tmp_path / f"rank{dist.get_rank()}.txt", "a", encoding="utf-8") as f:
                f.write(f"{pairs}\n")
        return forward(self, x_RH, local_idx_RK, w_RK, num_pairs, bounded)

    monkeypatch.setattr(expert_shard.ExpertShard, "forward", logged)
    return tmp_path
