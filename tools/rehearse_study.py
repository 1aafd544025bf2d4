"""Each study cell's written files, rehearsed on CPU ranks (docs/planner.md section 15): for every cell of the planner's
study, the ds_config ``disagmoe-plan --write-ds-config`` writes for it (AF-Pipe or co-located, whichever it
recommends), then that layout's shape at CPU size, with the model's tiny sibling (``hf_models/tiny-*`` of the same
``model_type``), trained for 2 steps by ``run_pretrain.py`` on gloo ranks. At CPU size (8 ranks at most) every
degree above 1 is 2 (PP, virtual stages, TP, Ulysses, EP, AF-Pipe's depth, node dedup, and data or expert replicas
where the 8 ranks leave room: the attention lanes' replicas give way first, then the experts') and every other key
of the section (recompute, ZeRO per side, offload shares, resend) is kept as written.
Prints a table; about 30 minutes on 2 cores (the DeepSeek-V3 plans take most of it).

    python tools/rehearse_study.py [--models Qwen3-30B-A3B] [--seq-len 4096]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from disagmoe_ds.planner.cli import main as plan
from disagmoe_ds.planner.pipeline_split import chunk_sizes
from disagmoe_ds.planner.study import ISSUE_16_GRID, SEQ_LENS

ROOT = Path(__file__).resolve().parents[1]
MAX_RANKS = 8  # what 2 CPU cores run in a few seconds a step


def sibling(model: Path) -> Path:
    """The tiny model of ``model``'s family shipped in hf_models/."""
    family = _config(model)["model_type"]
    tiny = sorted(d for d in model.parent.glob("tiny-*") if _config(d)["model_type"] == family)
    if not tiny:
        raise SystemExit(f"no tiny sibling of {model.name} ({family}) in {model.parent}")
    return tiny[0]


def _config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def _two(n: int) -> int:
    return min(n, 2)


def colocated_rehearsal(placed: dict, layers: int) -> tuple[dict, int]:
    """A co-located "colocated" section at CPU size, and its micro-batches (a multiple of the stages, as interleaved
    1F1B needs)."""
    pp, v = _two(placed.get("pp_size", 1)), _two(placed.get("virtual_stages", 1))
    s, t, ep = (_two(placed.get(key, 1)) for key in ("sequence_parallel", "tensor_parallel", "ep_size"))
    stage = math.lcm(ep, s * t)
    written_stage = placed["world_size"] // placed.get("pp_size", 1)
    written_min = math.lcm(placed["ep_size"], placed.get("sequence_parallel", 1) * placed.get("tensor_parallel", 1))
    if written_stage > written_min and 2 * pp * stage <= MAX_RANKS:  # the plan has data parallelism: keep some
        stage *= 2
    small = {"world_size": pp * stage, "ep_size": ep}
    small |= {key: d for key, d in (("sequence_parallel", s), ("tensor_parallel", t)) if d > 1}
    if pp > 1:
        small |= {"pp_size": pp, "virtual_stages": v, "stage_layers": list(chunk_sizes(layers, pp, v) or ())}
    return small, 2 * pp


def disaggregated_rehearsal(section: dict) -> dict:
    """An AF-Pipe section's layout keys at CPU size."""
    depth = section["depth"]
    s, t = (section.get(key, 1) for key in ("sequence_parallel", "tensor_parallel"))
    a_group, f_group = section["attention_gpus"] // depth, section["ffn_gpus"] // depth
    edp = section.get("expert_data_parallel", 1)
    d2, s2, t2, ep2, edp2 = _two(depth), _two(s), _two(t), _two(f_group // edp), _two(edp)
    a2 = s2 * t2 * (2 if a_group > s * t else 1)
    while d2 * (a2 + ep2 * edp2) > MAX_RANKS:  # the lanes' replicas go first, then the experts'
        if a2 > s2 * t2:
            a2 //= 2
        elif edp2 > 1:
            edp2 = 1
        else:
            d2 = 1
    small = {"attention_gpus": d2 * a2, "ffn_gpus": d2 * ep2 * edp2, "depth": d2, "expert_data_parallel": edp2}
    small |= {key: d for key, d in (("sequence_parallel", s2), ("tensor_parallel", t2)) if d > 1}
    if section.get("node_dedup", 1) > 1:
        small["node_dedup"] = _two(section["node_dedup"]) if ep2 > 1 else 1
    return small


def rehearsal(ds: dict, layers: int) -> dict:
    """The written ds_config ``ds`` at CPU size (module docstring), for a model of ``layers`` decoder layers."""
    section = dict(ds["disagmoe"])
    if "colocated" in section:
        section["colocated"], section["micro_batches"] = colocated_rehearsal(section["colocated"], layers)
    else:
        section |= disaggregated_rehearsal(section)
        section["micro_batches"] = 4 * section["depth"]
        if section.get("max_in_flight"):
            section["max_in_flight"] = min(section["max_in_flight"], section["micro_batches"])
    return ds | {"disagmoe": section}


def layout(section: dict) -> str:
    """The layout keys of a "disagmoe" section in one line."""
    if "colocated" in section:
        return "co-located " + " ".join(f"{k}={v}" for k, v in section["colocated"].items() if k != "stage_layers")
    keys = ("attention_gpus", "ffn_gpus", "depth", "expert_data_parallel", "sequence_parallel", "tensor_parallel",
            "node_dedup")  # fmt: skip
    return "AF-Pipe " + " ".join(f"{k}={section[k]}" for k in keys if k in section)


def rehearse(model: str, nodes: int, seq_len: int, work: Path) -> str:
    """One table row: the cell's written layout, its CPU-size layout, and the 2-step run's outcome."""
    hf = ROOT / "hf_models" / model
    written_file, small_file, metrics = work / "ds.json", work / "small.json", work / "metrics.jsonl"
    argv = ["--model", str(hf), "--seq-len", str(seq_len), "--cluster", "h800", "--nodes", str(nodes),
            "--global-batch-size", str(8 * 8 * nodes), "--write-ds-config", str(written_file)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if plan(argv) != 0:
            return f"| {model} | {nodes} | {seq_len // 1024}K | nothing written | | |"
    written = json.loads(written_file.read_text())
    tiny = sibling(hf)
    small = rehearsal(written, _config(tiny)["num_hidden_layers"])
    small_file.write_text(json.dumps(small, indent=2))
    run = [sys.executable, str(ROOT / "run_pretrain.py"), "--deepspeed_config", str(small_file), "--model", str(tiny),
           "--seq-len", "32", "--dtype", "fp32", "--steps", "2", "--log-every", "1", "--metrics-file", str(metrics),
           "--tokenizer-cache", str(work.parent / "tokenizers")]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(run, capture_output=True, text=True, timeout=600, check=False)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        outcome = f"failed (exit {done.returncode}): {tail}"
    else:
        losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
        outcome = f"2 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, {seconds:.0f} s"
    return (f"| {model} | {nodes} | {seq_len // 1024}K | {layout(written['disagmoe'])} | {tiny.name}: "
            f"{layout(small['disagmoe'])} | {outcome} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="", help="comma-separated model directory names (default: the study's)")
    p.add_argument("--seq-len", default=",".join(map(str, SEQ_LENS)), help="comma-separated sequence lengths")
    a = p.parse_args()
    wanted = {m for m in a.models.split(",") if m}
    seq_lens = [int(s) for s in a.seq_len.split(",")]
    print("| model | nodes | seq | written | rehearsed on CPU ranks | outcome |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n, (model, nodes) in enumerate((m, n) for m, n in ISSUE_16_GRID if not wanted or m in wanted):
            for seq_len in seq_lens:
                work = Path(tmp) / f"{n}-{seq_len}"
                work.mkdir()
                print(rehearse(model, nodes, seq_len, work), flush=True)


if __name__ == "__main__":
    main()
