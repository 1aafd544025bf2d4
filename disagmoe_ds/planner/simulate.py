"""Discrete-event simulation of a step: AF-Pipe through ``disagmoe_ds.schedule`` and co-located EP+DP
interleaved 1F1B (Megatron's schedule with virtual stages) written here; timelines as PNG/SVG or Chrome trace.

Both report the step time and how it splits (GPU-weighted over workers):
compute (busy), exposed communication = (step - step with free communication) / step, and bubble = the rest.

>>> r = simulate_baseline(BaselineChunkCosts((1.0,), (2.0,), (0.0,), (0.0,), 0.0, 0.0), pp=1, vpp=1,
...                       micro_batches=4)
>>> r.step_time_s, r.bubble_fraction
(12.0, 0.0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.task_costs import AfTaskCosts
from disagmoe_ds.planner.zerobubble import simulate_split_backward
from disagmoe_ds.schedule import Costs, PipeShape, TimelineEvent, write_chrome_trace

_MESSAGE_KINDS = ("m2n", "n2m", "resid", "m2n_grad", "n2m_grad", "resid_grad")
Unit = TypeVar("Unit")


@dataclass(frozen=True)
class SimResult:
    """Predicted step of one system; fractions are of the step time and sum to 1."""

    system: str
    step_time_s: float
    compute_fraction: float
    exposed_comm_fraction: float
    events: tuple[TimelineEvent, ...]

    @classmethod
    def from_steps(
        cls,
        system: str,
        *,
        step_s: float,
        free_step_s: float,
        compute_fraction: float,
        events: tuple[TimelineEvent, ...] = (),
    ) -> SimResult:
        """``free_step_s`` is the same step with communication free: what the step loses to it is exposed."""
        return cls(system, step_s, compute_fraction, max(0.0, step_s - free_step_s) / step_s, events)

    @property
    def bubble_fraction(self) -> float:
        return max(0.0, 1.0 - self.compute_fraction - self.exposed_comm_fraction)


# ----- AF-Pipe -----
def schedule_costs(spec: ModelSpec, task_costs: AfTaskCosts, *, with_comm: bool = True) -> Costs:
    """``schedule.Costs`` from per-layer costs: the first MoE layer's values as defaults, overrides elsewhere."""
    ref = spec.moe_layers.index(True)
    per_layer = dict(task_costs.per_layer)
    if not with_comm:
        per_layer.update({k: (0.0,) * spec.num_layers for k in _MESSAGE_KINDS})
    per_layer.update({f"{side}_wgt": per for side, per in task_costs.wgrad.items()})  # split backward: the W tasks
    defaults = {k.lower(): v[ref] for k, v in per_layer.items()}
    overrides = {(k, i): v[i] for k, v in per_layer.items() for i in range(spec.num_layers) if v[i] != v[ref]}
    head = {"head_fwd": task_costs.head_fwd, "head_bwd": task_costs.head_bwd, "head_wgt": task_costs.head_wgrad}
    return Costs(**defaults, **head, overrides=overrides)


def simulate_af(
    spec: ModelSpec,
    layout: Layout,
    task_costs: AfTaskCosts,
    *,
    micro_batches: int,
    max_in_flight: int,
    exposed_comm: bool = True,
    events: bool = True,
) -> SimResult:
    """Generate the AF-Pipe instruction streams for the plan and read their predicted timeline.

    ``exposed_comm=False`` skips the second, communication-free run (its fraction is then reported as 0);
    ``events=False`` the timeline (the search needs the step only).
    The step comes from ``zerobubble.py``, which is the generator's simulation plus, with a split backward,
    the deferred weight-gradient tasks.
    """
    shape = PipeShape(depth=layout.depth, num_layers=spec.num_layers, moe_layers=spec.moe_layers)
    cap = min(max_in_flight, micro_batches)
    weights = {w: layout.lanes if w.side == "A" else layout.ffn_ranks_per_group for w in shape.workers}
    step, busy, timeline = _run_af(shape, micro_batches, spec, task_costs, cap, with_comm=True, events=events)
    compute = sum(weights[w] * busy[w] for w in weights) / sum(weights.values())
    free_step = step
    if exposed_comm:
        free_step = _run_af(shape, micro_batches, spec, task_costs, cap, with_comm=False, events=False)[0]
    variant = ", split backward" if task_costs.wgrad else ""
    system = f"AF-Pipe (p={layout.depth}, {micro_batches} micro-batches, {cap} in flight{variant})"
    return SimResult.from_steps(system, step_s=step, free_step_s=free_step, compute_fraction=compute, events=timeline)


def _run_af(
    shape: PipeShape,
    micro_batches: int,
    spec: ModelSpec,
    task_costs: AfTaskCosts,
    cap: int,
    *,
    with_comm: bool,
    events: bool,
) -> tuple[float, dict, tuple[TimelineEvent, ...]]:
    """(step, busy share per worker, timeline events) of one simulated AF-Pipe step."""
    costs = schedule_costs(spec, task_costs, with_comm=with_comm)
    # ``generate``'s own simulation (with a split backward's W tasks when costed), minus building instruction streams.
    return simulate_split_backward(shape, micro_batches, costs, cap=cap, events=events)


# ----- co-located EP + DP, interleaved 1F1B -----
@dataclass(frozen=True)
class BaselineChunkCosts:
    """Seconds per (chunk, micro-batch) on one co-located rank: compute and exposed all-to-all, fwd and bwd."""

    fwd_compute: tuple[float, ...]
    bwd_compute: tuple[float, ...]
    fwd_comm: tuple[float, ...]
    bwd_comm: tuple[float, ...]
    a2a_per_layer_s: float  # one dispatch or combine of one MoE layer, before overlap
    p2p_s: float


@dataclass(frozen=True)
class Op:
    """One chunk of one micro-batch on one pipeline rank."""

    forward: bool
    chunk: int
    micro_batch: int


def megatron_order(pp: int, vpp: int, micro_batches: int, rank: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B order for ``rank`` (``schedules.py``, forward_backward_pipelining_with_
    interleaving): warm-up of (pp - rank - 1) * 2 + (vpp - 1) * pp forwards (pp - rank - 1 without
    interleaving), then one forward one backward, then the remaining backwards. The k-th forward runs chunk
    (k // pp) % vpp of micro-batch (k // (pp * vpp)) * pp + k % pp; backwards visit chunks in reverse.

    >>> [f"{'F' if o.forward else 'B'}{o.chunk}.{o.micro_batch}" for o in megatron_order(2, 2, 2, 1)]
    ['F0.0', 'F0.1', 'F1.0', 'B1.0', 'F1.1', 'B1.1', 'B0.0', 'B0.1']
    """
    total = micro_batches * vpp
    warmup = pp - rank - 1 if vpp == 1 else (pp - rank - 1) * 2 + (vpp - 1) * pp
    warmup = min(warmup, total)

    def op(k: int, forward: bool) -> Op:
        chunk = (k // pp) % vpp
        return Op(forward, chunk if forward else vpp - 1 - chunk, (k // (pp * vpp)) * pp + k % pp)

    order = [op(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op(warmup + k, True), op(k, False)]
    return order + [op(k, False) for k in range(total - warmup, total)]


def simulate_baseline(costs: BaselineChunkCosts, *, pp: int, vpp: int, micro_batches: int) -> SimResult:
    """Co-located EP+DP interleaved 1F1B; a chunk's exposed all-to-all runs inside its op on the critical path."""
    timed = _run_1f1b(costs, pp=pp, vpp=vpp, micro_batches=micro_batches)
    zero = (0.0,) * len(costs.fwd_comm)
    free = _run_1f1b(
        replace(costs, fwd_comm=zero, bwd_comm=zero, p2p_s=0.0), pp=pp, vpp=vpp, micro_batches=micro_batches
    )
    step = max(end for _, _, end, _ in timed)
    return SimResult.from_steps(
        f"co-located 1F1B (pp={pp}, v={vpp}, {micro_batches} micro-batches)",
        step_s=step,
        free_step_s=max(end for _, _, end, _ in free),
        compute_fraction=sum(c for _, _, _, c in timed) / (pp * step),
        events=tuple(_baseline_events(timed, costs, vpp)),
    )


def baseline_closed_form(costs: BaselineChunkCosts, *, pp: int, vpp: int, micro_batches: int) -> float:
    """(m * v + pp - 1) * (t_f + t_b) for uniform chunks without communication (Narayanan et al. 2021, sec. 2.2)."""
    t = costs.fwd_compute[0] + costs.bwd_compute[0] + costs.fwd_comm[0] + costs.bwd_comm[0]
    return (micro_batches * vpp + pp - 1) * t


def _run_1f1b(
    costs: BaselineChunkCosts, *, pp: int, vpp: int, micro_batches: int
) -> list[tuple[int, Op, float, float]]:
    """(rank, op, end, compute seconds) per op; each rank runs its order, each op waits for its input."""
    done: dict[tuple[bool, int, int], float] = {}
    free, out, last = [0.0] * pp, [], pp * vpp - 1

    def start(r: int, op: Op) -> bool:
        stage = op.chunk * pp + r
        ready = input_ready(done, op, stage, last, pp, costs.p2p_s)
        if ready is None:
            return False
        comp = (costs.fwd_compute if op.forward else costs.bwd_compute)[stage]
        comm = (costs.fwd_comm if op.forward else costs.bwd_comm)[stage]
        end = max(free[r], ready) + comp + comm
        done[op.forward, stage, op.micro_batch] = free[r] = end
        out.append((r, op, end, comp))
        return True

    orders = [megatron_order(pp, vpp, micro_batches, r) for r in range(pp)]
    run_in_order(orders, start, deadlock="baseline 1F1B simulation deadlocked; the schedule order is inconsistent")
    return out


def run_in_order(orders: Sequence[Sequence[Unit]], start: Callable[[int, Unit], bool], *, deadlock: str) -> None:
    """Run each rank's ``orders[rank]`` in sequence, sweeping the ranks in turn until all are done.

    ``start(rank, unit)`` runs the rank's next unit if its inputs are ready and says whether it did; a sweep in
    which no rank can start means the orders wait on each other (``RuntimeError(deadlock)``)."""
    pos = [0] * len(orders)
    while any(p < len(order) for p, order in zip(pos, orders)):
        progressed = False
        for r, order in enumerate(orders):
            if pos[r] < len(order) and start(r, order[pos[r]]):
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(deadlock)


def input_ready(done: dict, op: Op, stage: int, last: int, pp: int, p2p_s: float) -> float | None:
    """When the op's input is available on its rank, or None if its producer has not run yet."""
    if op.forward:
        if stage == 0:
            return 0.0
        src = (True, stage - 1, op.micro_batch)
    else:
        src = (True, stage, op.micro_batch) if stage == last else (False, stage + 1, op.micro_batch)
    if src not in done:
        return None
    same_rank = src[1] % pp == stage % pp
    return done[src] + (0.0 if same_rank else p2p_s)


def _baseline_events(timed: list, costs: BaselineChunkCosts, vpp: int) -> list[TimelineEvent]:
    pp = len({r for r, _, _, _ in timed})
    events = []
    for r, op, end, comp in timed:
        stage = op.chunk * pp + r
        comm = (costs.fwd_comm if op.forward else costs.bwd_comm)[stage]
        start = end - comp - comm
        name = f"{'F' if op.forward else 'B'}{op.chunk}.{op.micro_batch}"
        args = {"chunk": op.chunk, "micro_batch": op.micro_batch}
        events.append(TimelineEvent(f"stage{r}", name, "compute", start, start + comp, args))
        if comm > 0:
            events.append(TimelineEvent(f"stage{r}", f"{name} all-to-all", "wait", start + comp, end, args))
    return events


# ----- drawing -----
def write_timeline(events: tuple[TimelineEvent, ...], path: str | Path, title: str = "") -> None:
    """``.json``: Chrome trace (Perfetto); ``.png`` / ``.svg``: a Gantt chart drawn with matplotlib."""
    path = Path(path)
    if path.suffix == ".json":
        write_chrome_trace(events, path)
        return
    import matplotlib  # lazily: plotting is optional (extras "plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({e.worker for e in events})
    colours = {"compute": "tab:blue", "wait": "tab:red", "send": "tab:green", "recv": "tab:olive"}
    fig, ax = plt.subplots(figsize=(14, 0.5 + 0.45 * len(workers) * 2))
    for e in events:
        row = workers.index(e.worker) * 2 + (0 if e.category == "compute" else 1)
        backward = e.name.startswith("B")
        colour = "tab:orange" if e.category == "compute" and backward else colours.get(e.category, "grey")
        ax.barh(row, e.end_s - e.start_s, left=e.start_s, height=0.8, color=colour, edgecolor="none")
    ax.set_yticks([2 * i + j for i in range(len(workers)) for j in (0, 1)])
    ax.set_yticklabels([f"{w} {kind}" for w in workers for kind in ("compute", "comm")], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or "predicted timeline (blue fwd, orange bwd, green/olive transfers, red exposed all-to-all)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
