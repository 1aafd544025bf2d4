"""tools/rehearse_study.py: a study cell's written layout at CPU size keeps every degree the plan has above 1 (at 2),
fits 8 ranks, and passes run_pretrain.py's own parsing and pre-launch checks with the model's tiny sibling (the tool
then trains it 2 steps; docs/planner.md section 15 records that run for every cell)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from disagmoe_ds.train import run as job
from disagmoe_ds.train.args import parse_args
from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("rehearse_study", ROOT / "tools" / "rehearse_study.py")
rehearse_study = importlib.util.module_from_spec(_spec)
sys.modules["rehearse_study"] = rehearse_study
_spec.loader.exec_module(rehearse_study)

MODELS = ROOT / "hf_models"
DEGREES = ("pp_size", "virtual_stages", "sequence_parallel", "tensor_parallel", "ep_size", "depth", "node_dedup")
SIZES = ("colocated", "attention_gpus", "ffn_gpus", "expert_data_parallel", "micro_batches", "max_in_flight")
TRAINING = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}

# Layouts as disagmoe-plan writes them for study cells (tools/rehearse_study.py's table).
WRITTEN = {
    "Qwen3-30B-A3B": {  # 4 nodes, 4K: AF-Pipe with TP lanes, expert replicas and node dedup
        "attention_gpus": 12, "ffn_gpus": 20, "depth": 2, "expert_data_parallel": 5, "tensor_parallel": 2,
        "node_dedup": 2, "micro_batches": 64, "max_in_flight": 6, "cluster": "h800",
        "recompute": {"attention": "none", "ffn": "full"}, "zero_stage": {"attention": 1, "ffn": 2},
    },
    "Qwen3-235B-A22B": {  # Ulysses and TP lanes in interleaved stages
        "colocated": {"world_size": 128, "ep_size": 2, "sequence_parallel": 4, "tensor_parallel": 2, "pp_size": 4,
                      "virtual_stages": 4, "stage_layers": [6] * 16},
        "micro_batches": 256, "activation_checkpointing": True, "selective_recompute": False,
    },
    "DeepSeek-V3": {  # TP 4 EP 8 in 32 stages, with data parallelism inside a stage
        "colocated": {"world_size": 512, "ep_size": 8, "tensor_parallel": 4, "pp_size": 32, "virtual_stages": 1,
                      "stage_layers": [1] + [2] * 30 + [0]},
        "micro_batches": 512, "activation_checkpointing": False, "selective_recompute": True,
    },
}  # fmt: skip


def _degrees(section: dict) -> dict[str, int]:
    placed = section.get("colocated", section)
    return {key: placed[key] for key in DEGREES if placed.get(key, 1) > 1}


@pytest.mark.parametrize("model", list(WRITTEN))
def test_a_written_layout_rehearses_at_cpu_size(tmp_path, model):
    tiny = rehearse_study.sibling(MODELS / model)
    assert json.loads((tiny / "config.json").read_text())["model_type"] in tiny.name.replace("-", "_")
    written = TRAINING | {"disagmoe": WRITTEN[model]}
    small = rehearse_study.rehearsal(written, layers=4)
    kept = _degrees(small["disagmoe"])
    assert kept.keys() == _degrees(written["disagmoe"]).keys() and set(kept.values()) == {2}, kept
    rest = {k: v for k, v in written["disagmoe"].items() if k not in (*DEGREES, *SIZES)}
    assert {k: small["disagmoe"][k] for k in rest} == rest  # recompute, ZeRO per side, ...: as written

    ds = tmp_path / "small.json"
    ds.write_text(json.dumps(small))
    args, _ = parse_args(["--deepspeed_config", str(ds), "--model", str(tiny), "--seq-len", "32"], root=ROOT,
                         description="")  # fmt: skip
    job.preflight_run(args, args.cfg.world_size)
    assert args.cfg.world_size <= rehearse_study.MAX_RANKS
