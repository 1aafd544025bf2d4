"""Experiment tracking: every step's scalars reach the monitors the ds_config enables (DeepSpeed's ``monitor``
sections), each monitor is checked before launch, and a resumed run's metrics file reads as one run."""

from __future__ import annotations

import csv
import json
from xml.etree import ElementTree

from tests.runs import ROOT, assert_refused_before_launch, pretrain, records


def _ds_config(tmp_path, **sections) -> str:
    ds = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ds, **sections}))
    return str(path)


def _csv_rows(folder, name: str) -> list[tuple[int, float]]:
    with (folder / f"{name}.csv").open() as handle:
        return [(int(step), float(value)) for step, value in list(csv.reader(handle))[1:]]


def test_a_csv_monitor_records_the_loss_and_eval_loss_of_every_step(tok_cache, tmp_path) -> None:
    ds = _ds_config(tmp_path, csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"})
    metrics = tmp_path / "m.jsonl"
    evaluate = ("--eval-split", 0.002, "--eval-steps", 1, "--eval-every", 2)
    assert pretrain(tok_cache, "--deepspeed_config", ds, "--steps", 3, "--metrics-file", metrics, *evaluate) == 0
    logged = {r["step"]: r for r in records(metrics) if "loss" in r}
    evaluated = [(r["step"], r["eval_loss"]) for r in records(metrics) if "eval_loss" in r]
    assert ElementTree.parse(metrics.with_suffix(".svg")).getroot().tag.endswith("svg")  # the loss plot
    folder = tmp_path / "csv" / "run"
    for name, field in (("train_loss", "loss"), ("train_grad_norm", "grad_norm")):
        assert _csv_rows(folder, name) == [(s, logged[s][field]) for s in (1, 2, 3)]
    assert [step for step, _ in _csv_rows(folder, "perf_tokens_per_s")] == [1, 2, 3]
    assert [step for step, _ in evaluated] == [2, 3]  # every 2 steps and at the end
    assert _csv_rows(folder, "eval_lm_loss") == evaluated


def test_a_monitor_whose_package_is_missing_is_refused_before_launch(tok_cache, tmp_path, capfd) -> None:
    ds = _ds_config(tmp_path, comet={"enabled": True})
    message = r'ds_config "comet" is enabled but the comet_ml package is not installed: pip install comet-ml'
    assert_refused_before_launch(tok_cache, capfd, ["--deepspeed_config", ds], message)


def test_a_resumed_runs_metrics_file_holds_each_step_once(tok_cache, tmp_path) -> None:
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    assert pretrain(tok_cache, "--steps", 3, "--save-dir", ck, "--save-every", 1, "--metrics-file", metrics) == 0
    with metrics.open("a") as handle:
        handle.write('{"step": 4, "lo')  # a killed run's half-written line
    assert pretrain(tok_cache, "--steps", 3, "--resume", ck / "step1", "--metrics-file", metrics) == 0
    assert [r["step"] for r in records(metrics)] == [1, 2, 3]


def test_the_loss_plot_draws_training_and_eval_loss(tmp_path) -> None:
    from disagmoe_ds.plot import main

    metrics = tmp_path / "m.jsonl"
    rows = [
        {"step": s, "loss": 6.0 - s / 10} | ({"eval_loss": 6.1 - s / 10} if s % 5 == 0 else {}) for s in range(1, 21)
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 21, "lo')
    assert main([str(metrics)]) == 0
    svg = ElementTree.parse(tmp_path / "m.svg").getroot()
    paths = [e for e in svg.iter() if e.tag.endswith("path") and e.get("stroke") != "black"]
    assert [p.get("d").count("L") for p in paths] == [19, 3]  # 20 training points, 4 evaluations
    assert "training loss (last 4.000)" in ElementTree.tostring(svg, encoding="unicode")
    assert main([str(tmp_path / "missing.jsonl")]) == 2
