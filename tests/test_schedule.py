"""Tests of the pure-Python AF-Pipe schedule: task graph, generator, instruction streams, checker, traces."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagmoe_ds.schedule import (
    SELF_SIZED,
    ComputeInstruction,
    Costs,
    ForwardAttn,
    Kind,
    PipeShape,
    PostRecv,
    Schedule,
    ScheduleError,
    Send,
    Task,
    Transfer,
    WaitRecv,
    Worker,
    build_graph,
    check_streams,
    default_max_in_flight,
    generate,
    render,
    size_sources,
    to_chrome_trace,
    write_chrome_trace,
)
from disagmoe_ds.schedule.generator import _Simulation

REPO = Path(__file__).resolve().parents[1]
A0, A1, F0 = Worker("A", 0), Worker("A", 1), Worker("F", 0)
# Every transfer and compute costs 1 s: small integers that the hand timelines below can add up.
UNIT = Costs(a_bwd=1, f_bwd=1, head_bwd=1, m2n=1, n2m=1, resid=1, m2n_grad=1, n2m_grad=1, resid_grad=1)
DENSE_FIRST = PipeShape(2, 4, (False, True, True, True))  # DeepSeek first_k_dense_replace=1
SHAPES = [
    PipeShape(1, 1, (True,)),
    PipeShape(1, 2, (True, True)),
    PipeShape(2, 2, (True, True)),
    DENSE_FIRST,
    PipeShape(1, 4, (True, False, True, False)),  # Qwen decoder_sparse_step=2
    PipeShape(2, 4, (True, True, False, True)),  # F0 runs one MoE layer, F1 two
    PipeShape(4, 8, (False,) + (True,) * 7),
]


def _ids(shape: PipeShape) -> str:
    return f"p{shape.depth}-L{shape.num_layers}-" + "".join("M" if m else "D" for m in shape.moe_layers)


def _in_flight_peak(schedule: Schedule, worker: Worker) -> tuple[int, list[int]]:
    """Most micro-batches held at once by ``worker``, and the order in which it admits them."""
    total = {m: 0 for m in range(schedule.graph.num_micro_batches)}
    for task in schedule.graph.tasks[worker]:
        total[task.micro_batch] += 1
    done, admitted, peak = dict.fromkeys(total, 0), [], 0
    for ins in schedule.streams[worker]:
        if isinstance(ins, ComputeInstruction):
            m = ins.micro_batch
            if m not in admitted:
                admitted.append(m)
            peak = max(peak, sum(done[k] < total[k] for k in admitted))
            done[m] += 1
    return peak, admitted


# ----- generated schedules keep the contract -----


@pytest.mark.parametrize("max_in_flight", [None, 1, 2])
@pytest.mark.parametrize("num_micro_batches", [1, 3, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_generated_streams_pass_checker(shape: PipeShape, num_micro_batches: int, max_in_flight: int | None) -> None:
    schedule = generate(shape, num_micro_batches, max_in_flight=max_in_flight)
    check_streams(schedule.streams)
    for worker, tasks in schedule.graph.tasks.items():
        computed = [ins for ins in schedule.streams[worker] if isinstance(ins, ComputeInstruction)]
        assert len(computed) == len(tasks)
        peak, admitted = _in_flight_peak(schedule, worker)
        assert peak <= schedule.max_in_flight
        assert admitted == sorted(admitted)
    assert all(schedule.busy_fraction[w] > 0 for w, tasks in schedule.graph.tasks.items() if tasks)


@pytest.mark.parametrize("lookahead", [0, 1, 2, 100])
def test_every_lookahead_passes_checker(lookahead: int) -> None:
    check_streams(generate(DENSE_FIRST, 8, lookahead=lookahead).streams)


def test_waits_follow_send_order_even_where_tasks_do_not() -> None:
    # p=4 with a dense first layer: some worker runs a task whose message was sent after another one on the same
    # channel, so it waits for the earlier one first (receivers complete a channel's messages oldest first).
    streams = generate(PipeShape(4, 8, (False,) + (True,) * 7), 8).streams
    order: dict[type, dict] = {Send: {}, PostRecv: {}, WaitRecv: {}}
    early_waits = 0
    for stream in streams.values():
        for i, ins in enumerate(stream):
            if type(ins) in order:
                order[type(ins)].setdefault(ins.transfer.channel, []).append(ins.transfer)
            if isinstance(ins, WaitRecv):
                c = next(c for c in stream[i:] if isinstance(c, ComputeInstruction))
                early_waits += c.task != ins.transfer.dst
    assert order[PostRecv] == order[Send] == order[WaitRecv]
    assert early_waits > 0


# ----- graph counts, by hand -----


def test_graph_counts_single_group() -> None:
    # p=1, L=1, one MoE layer, 1 micro-batch: A_fwd 0,1 + A_bwd 0,1 on A0, F_fwd 0 + F_bwd 0 on F0 = 6 tasks;
    # messages m2n, n2m, n2m_grad, m2n_grad = 4 (resid and resid_grad stay on A0).
    graph = build_graph(PipeShape(1, 1, (True,)), 1)
    assert {str(w): len(ts) for w, ts in graph.tasks.items()} == {"A0": 4, "F0": 2}
    assert sorted(m.kind for m in graph.remote_transfers) == ["m2n", "m2n_grad", "n2m", "n2m_grad"]
    # ... which are hand-offs: transfers within A0, in the streams as every transfer is, with no link time.
    assert sorted(t.kind for t in graph.hand_offs) == ["resid", "resid_grad"]
    assert all(t.src_worker == t.dst_worker == A0 for t in graph.hand_offs)
    schedule = generate(PipeShape(1, 1, (True,)), 1)
    sent = [ins.transfer for ins in schedule.streams[A0] if isinstance(ins, Send)]
    assert set(graph.hand_offs) <= set(sent) and not set(graph.hand_offs) & set(schedule.transfers)


def test_graph_counts_dense_first_layer() -> None:
    # p=2, L=4, layers 1-3 MoE, 3 micro-batches. Per micro-batch: A tasks 2 * (L + 1) = 10, F tasks 2 * 3 = 6;
    # messages 4 per MoE layer (12) + resid and resid_grad per layer boundary (2 * 4) = 20.
    graph = build_graph(DENSE_FIRST, 3)
    assert sum(len(ts) for ts in graph.tasks.values()) == 3 * 16
    assert len(graph.remote_transfers) == 3 * 20
    assert sum(m.kind == "m2n" for m in graph.remote_transfers) == 3 * 3
    # Channels: resid A0->A1 (l=1,3) and A1->A0 (l=2,4); m2n A1->F1 (l=1,3), A0->F0 (l=2); n2m F1->A0 (l=2,4),
    # F0->A1 (l=3); each mirrored by its grad channel: 12 channels.
    assert len({m.channel for m in graph.remote_transfers}) == 12
    assert set(graph.deps[Task("A_fwd", 2, 0)]) == {Task("A_fwd", 1, 0), Task("F_fwd", 1, 0)}


# ----- where each receive's sizes come from -----


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_every_receive_is_sized_by_a_transfer_its_receiver_has_seen(shape: PipeShape) -> None:
    """``size_sources``: every message not sized by itself (a header or a capacity) names its source, which its
    receiver sent, or posted the receive of, before it waits for the message: so the mailbox knows the sizes by then
    (a source received needs its header read; a source sent, the send made)."""
    schedule = generate(shape, 3)
    table = size_sources(schedule.graph)
    assert set(table) == {m for m in schedule.graph.remote_transfers if m.kind not in SELF_SIZED}
    for receive, source in table.items():
        stream = schedule.streams[receive.dst_worker]
        wait = stream.index(WaitRecv(receive))
        seen = Send(source) if source.src_worker == receive.dst_worker else PostRecv(source)
        assert seen in stream[:wait], (receive, source)
        assert source.src.micro_batch == receive.src.micro_batch


def test_the_size_convention_by_hand() -> None:
    """A gradient is sized by the forward transfer it answers; the expert outputs into A_fwd(l + 1) by the residual
    into the same task (at p = 1 a hand-off). The mailbox's rules (``afpipe.mailbox._SIZES_FROM``) read exactly
    these pairs: changing one here must change them there."""
    graph = build_graph(PipeShape(2, 2, (True, True)), 1)
    table = size_sources(graph)
    pairs = {(r.kind, s.kind) for r, s in table.items()}
    assert pairs == {
        (Kind.M2N_GRAD, Kind.M2N),
        (Kind.N2M_GRAD, Kind.N2M),
        (Kind.RESID_GRAD, Kind.RESID),
        (Kind.N2M, Kind.RESID),
    }
    a_fwd, a_bwd, f_fwd, f_bwd = (Task(kind, 0, 0) for kind in ("A_fwd", "A_bwd", "F_fwd", "F_bwd"))
    A_1, F_0 = Worker("A", 1), Worker("F", 0)
    m2n = Transfer(Kind.M2N, a_fwd, f_fwd, A0, F_0)
    assert table[Transfer(Kind.M2N_GRAD, f_bwd, a_bwd, F_0, A0)] == m2n
    n2m = Transfer(Kind.N2M, f_fwd, Task("A_fwd", 1, 0), F_0, A_1)
    assert table[n2m] == Transfer(Kind.RESID, a_fwd, Task("A_fwd", 1, 0), A0, A_1)
    assert table[Transfer(Kind.N2M_GRAD, Task("A_bwd", 1, 0), f_bwd, A_1, F_0)] == n2m
    single = size_sources(build_graph(PipeShape(1, 1, (True,)), 1))  # p = 1: n2m sized by the hand-off
    (n2m_1,) = [r for r in single if r.kind == Kind.N2M]
    assert single[n2m_1].is_hand_off and single[n2m_1].kind == Kind.RESID


# ----- golden orders -----


def test_render_golden_single_group() -> None:
    # Cap 2: both micro-batches enter before the first backward; lowest layer first among forwards.
    assert generate(PipeShape(1, 2, (True, True)), 2).render() == (
        "A0: F0.0 F0.1 F1.0 F1.1 F2.0 B2.0 F2.1 B2.1 B1.0 B1.1 B0.0 B0.1\nF0: F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 B0.0 B0.1"
    )


def test_render_golden_two_groups() -> None:
    # Layer 1 on A1/F1; the head (layer 2) on A0, whose backward runs as soon as each head forward ends.
    assert generate(PipeShape(2, 2, (True, True)), 2).render() == (
        "A0: F0.0 F0.1 F2.0 B2.0 F2.1 B2.1 B0.0 B0.1\n"
        "A1: F1.0 F1.1 B1.0 B1.1\n"
        "F0: F0.0 F0.1 B0.0 B0.1\n"
        "F1: F1.0 F1.1 B1.0 B1.1"
    )


# ----- predicted times -----


def test_step_time_single_group_by_hand() -> None:
    # p=1, L=1, every cost 1 s. One micro-batch is a chain of 10: A_fwd0 m2n F_fwd0 n2m head head_bwd n2m_grad
    # F_bwd0 m2n_grad A_bwd0. Two micro-batches, cap 2:
    #   A0: F0.0 [0,1] F0.1 [1,2] F1.0 [4,5] B1.0 [5,6] F1.1 [6,7] B1.1 [7,8] B0.0 [9,10] B0.1 [11,12]
    #   F0: F0.0 [2,3] F0.1 [3,4] B0.0 [7,8] B0.1 [9,10]; the m2n_grad of mb 1 lands at 11.
    shape = PipeShape(1, 1, (True,))
    assert generate(shape, 1, costs=UNIT).step_time_s == 10.0
    schedule = generate(shape, 2, costs=UNIT, max_in_flight=2)
    assert schedule.step_time_s == 12.0
    assert schedule.busy_fraction == {A0: 8 / 12, F0: 4 / 12}


def test_cost_override_for_dense_layer() -> None:
    shape = PipeShape(1, 1, (True,))
    base = generate(shape, 1).step_time_s  # 1 + .5 + 1 + .5 + 1 + 2 + .5 + 2 + .5 + 2 = 11
    assert base == 11.0
    assert generate(shape, 1, costs=Costs(overrides={("A_fwd", 0): 3.0, ("m2n", 0): 1.5})).step_time_s == 14.0


@pytest.mark.parametrize("shape", [DENSE_FIRST, SHAPES[-1]], ids=_ids)
def test_more_micro_batches_fewer_bubbles(shape: PipeShape) -> None:
    bubbles = [generate(shape, m).bubble_fraction for m in (1, 3, 8)]
    means = [sum(b.values()) / len(b) for b in bubbles]
    assert means[0] > means[1] > means[2]


def test_f_group_without_moe_layer_warns_and_still_schedules() -> None:
    with pytest.warns(UserWarning, match=r"F-groups \[1\] own no MoE layer .* their GPUs idle the whole step"):
        shape = PipeShape(2, 4, (True, False, True, False))
    schedule = generate(shape, 3)
    check_streams(schedule.streams)
    assert [type(ins).__name__ for ins in schedule.streams[Worker("F", 1)]] == ["ReduceGrads", "OptimizerStep"]


def test_default_max_in_flight() -> None:
    assert default_max_in_flight(PipeShape(2, 4, (True,) * 4), 16) == 5  # 2p + 1
    assert default_max_in_flight(PipeShape(2, 4, (True,) * 4), 3) == 3  # never more than there are


# ----- checker catches broken streams -----


def _tiny_streams() -> dict[Worker, list]:
    return {w: list(s) for w, s in generate(PipeShape(1, 2, (True, True)), 2, lookahead=100).streams.items()}


def test_checker_catches_swapped_posts() -> None:
    streams = _tiny_streams()
    i, j = [k for k, ins in enumerate(streams[F0]) if isinstance(ins, PostRecv) and ins.transfer.kind == "m2n"][:2]
    streams[F0][i], streams[F0][j] = streams[F0][j], streams[F0][i]
    with pytest.raises(ScheduleError, match=r"F0: receive #0 on channel m2n:A0->F0 is posted for m2n 0\.1"):
        check_streams(streams)


def test_checker_catches_waits_out_of_send_order() -> None:
    x = Transfer(Kind.RESID, Task("A_fwd", 1, 0), Task("A_fwd", 2, 0), A1, A0)
    y = Transfer(Kind.RESID, Task("A_fwd", 1, 1), Task("A_fwd", 2, 1), A1, A0)
    streams = {A1: [Send(x), Send(y)], A0: [PostRecv(x), PostRecv(y), WaitRecv(y), WaitRecv(x)]}
    with pytest.raises(ScheduleError, match=r"A0: receive #0 on channel resid:A1->A0 is waited for resid 1\.1"):
        check_streams(streams)


def test_checker_catches_missing_send() -> None:
    streams = _tiny_streams()
    streams[A0].remove(next(ins for ins in streams[A0] if isinstance(ins, Send)))
    with pytest.raises(ScheduleError, match=r"m2n 0\.0 A0->F0: Send must appear once, in A0.s stream; found at no"):
        check_streams(streams)


def test_checker_catches_wait_before_post() -> None:
    streams = _tiny_streams()
    post = next(ins for ins in streams[F0] if isinstance(ins, PostRecv))
    streams[F0].remove(post)
    streams[F0].insert(len(streams[F0]) - 2, post)
    with pytest.raises(ScheduleError, match=r"F0: WaitRecv\(m2n 0\.0 A0->F0\) at \[\d+\] precedes its PostRecv"):
        check_streams(streams)


def test_checker_catches_cross_wait_cycle() -> None:
    # A0 waits for x from A1 before sending y; A1 waits for y before sending x.
    x = Transfer(Kind.RESID, Task("A_fwd", 1, 0), Task("A_fwd", 2, 0), A1, A0)
    y = Transfer(Kind.RESID, Task("A_fwd", 2, 0), Task("A_fwd", 3, 0), A0, A1)
    streams = {A0: [PostRecv(x), WaitRecv(x), Send(y)], A1: [PostRecv(y), WaitRecv(y), Send(x)]}
    with pytest.raises(ScheduleError, match=r"deadlock: A0 waits at \[1\] WaitRecv\(resid 1\.0 A1->A0\); A1 waits"):
        check_streams(streams)


def test_simulation_stall_is_reported() -> None:
    # generate() cannot stall (the oldest unfinished micro-batch is always admissible), so feed a graph with a
    # cycle: A_fwd(0) waiting on its own backward.
    graph = build_graph(PipeShape(1, 1, (True,)), 1)
    deps = {**graph.deps, Task("A_fwd", 0, 0): (Task("A_bwd", 0, 0),)}
    with pytest.raises(ScheduleError, match=r"stalled at t=0s with 6 tasks never started .*the graph has a cycle"):
        _Simulation(dataclasses.replace(graph, deps=deps), Costs(), 1).run()


def test_render_notation() -> None:
    assert render({A1: [ForwardAttn(3, 2)]}) == "A1: F3.2"


# ----- validation messages -----


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: PipeShape(3, 4, (True,) * 4), r"num_layers \(4\) must be divisible by depth \(3\)"),
        (lambda: PipeShape(2, 4, (True,) * 3), r"moe_layers has 3 entries, need one per layer \(4\)"),
        (lambda: PipeShape(1, 2, (False, False)), r"marks no MoE layer"),
        (lambda: PipeShape(0, 2, (True, True)), r"depth must be a positive integer, got 0"),
        (lambda: build_graph(SHAPES[0], 0), r"num_micro_batches must be a positive integer, got 0"),
        (lambda: generate(SHAPES[0], 2, max_in_flight=0), r"max_in_flight must be a positive integer, got 0"),
        (lambda: Costs(a_fwd=-1.0), r"Costs a_fwd must be a non-negative number of seconds, got -1.0"),
        (lambda: Costs(overrides={("attn", 0): 1.0}), r"unknown kinds \['attn'\]"),
    ],
)
def test_invalid_input_is_a_clear_error(build, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        build()


# ----- traces and purity -----


def test_chrome_trace_round_trips(tmp_path: Path) -> None:
    events = generate(DENSE_FIRST, 3).timeline_events()
    trace = to_chrome_trace(events)
    assert json.loads(json.dumps(trace)) == trace
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert sorted(names) == ["A0", "A1", "F0", "F1"]
    spans = sorted((e["pid"], e["tid"], e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X")
    assert len(spans) == len(events)
    for (pid, tid, _, end), (pid2, tid2, start2, _) in zip(spans, spans[1:]):
        assert (pid, tid) != (pid2, tid2) or end <= start2 + 1e-9, "events on one trace thread must not overlap"
    write_chrome_trace(events, tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text()) == trace


@pytest.mark.parametrize("module", ["", ".tasks", ".checker"])
def test_doctests(module: str) -> None:
    assert doctest.testmod(importlib.import_module("disagmoe_ds.schedule" + module)).failed == 0


def test_schedule_imports_neither_torch_nor_deepspeed() -> None:
    code = "import sys, disagmoe_ds.schedule; print(sorted({'torch', 'deepspeed'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
