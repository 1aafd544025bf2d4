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

from dataclasses import dataclass, replace
from pathlib import Path

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.stages import AfTaskCosts, BaselineChunkCosts
from disagmoe_ds.planner.zerobubble import simulate_split_backward
from disagmoe_ds.schedule import Costs, PipeShape, TimelineEvent, write_chrome_trace

_MESSAGE_KINDS = ("m2n", "n2m", "resid", "m2n_grad", "n2m_grad", "resid_grad")


@dataclass(frozen=True)
class SimResult:
    """Predicted step of one system; fractions are of the step time and sum to 1."""

    system: str
    step_time_s: float
    compute_fraction: float
    exposed_comm_fraction: float
    events: tuple[TimelineEvent, ...]

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
    defaults = {k.lower(): v[ref] for k, v in per_layer.items()}
    overrides = {(k, i): v[i] for k, v in per_layer.items() for i in range(spec.num_layers) if v[i] != v[ref]}
    return Costs(**defaults, head_fwd=task_costs.head_fwd, head_bwd=task_costs.head_bwd, overrides=overrides)


def simulate_af(
    spec: ModelSpec,
    layout: Layout,
    task_costs: AfTaskCosts,
    *,
    micro_batches: int,
    max_in_flight: int,
    exposed_comm: bool = True,
) -> SimResult:
    """Generate the AF-Pipe instruction streams for the plan and read their predicted timeline.

    ``exposed_comm=False`` skips the second, communication-free run (its fraction is then reported as 0).
    The step comes from ``zerobubble.py``, which is the generator's simulation plus, with a split backward,
    the deferred weight-gradient tasks.
    """
    shape = PipeShape(depth=layout.depth, num_layers=spec.num_layers, moe_layers=spec.moe_layers)
    cap = min(max_in_flight, micro_batches)
    weights = {w: layout.lanes if w.side == "A" else layout.ffn_ranks_per_group for w in shape.workers}
    step, busy, events = _run_af(shape, micro_batches, spec, task_costs, cap, with_comm=True)
    compute = sum(weights[w] * busy[w] for w in weights) / sum(weights.values())
    free_step = step
    if exposed_comm:
        free_step = _run_af(shape, micro_batches, spec, task_costs, cap, with_comm=False)[0]
    variant = ", split backward" if task_costs.wgrad else ""
    return SimResult(
        system=f"AF-Pipe (p={layout.depth}, {micro_batches} micro-batches, {cap} in flight{variant})",
        step_time_s=step,
        compute_fraction=compute,
        exposed_comm_fraction=max(0.0, step - free_step) / step,
        events=events,
    )


def _run_af(
    shape: PipeShape, micro_batches: int, spec: ModelSpec, task_costs: AfTaskCosts, cap: int, *, with_comm: bool
) -> tuple[float, dict, tuple[TimelineEvent, ...]]:
    """(step, busy share per worker, timeline events) of one simulated AF-Pipe step."""
    costs = schedule_costs(spec, task_costs, with_comm=with_comm)
    wgrad = {(f"{side}_wgt", i): v for side, per in task_costs.wgrad.items() for i, v in enumerate(per)}
    if task_costs.wgrad:
        wgrad["A_wgt", spec.num_layers] = task_costs.head_wgrad
    # Without weight-gradient tasks this is ``generate``'s own simulation, minus building instruction streams.
    return simulate_split_backward(shape, micro_batches, costs, cap=cap, wgrad=wgrad)


# ----- co-located EP + DP, interleaved 1F1B -----
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
    compute = sum(c for _, _, _, c in timed) / (pp * step)
    free_step = max(end for _, _, end, _ in free)
    events = tuple(_baseline_events(timed, costs, vpp))
    return SimResult(
        system=f"co-located 1F1B (pp={pp}, v={vpp}, {micro_batches} micro-batches)",
        step_time_s=step,
        compute_fraction=compute,
        exposed_comm_fraction=max(0.0, step - free_step) / step,
        events=events,
    )


def baseline_closed_form(costs: BaselineChunkCosts, *, pp: int, vpp: int, micro_batches: int) -> float:
    """(m * v + pp - 1) * (t_f + t_b) for uniform chunks without communication (Narayanan et al. 2021, sec. 2.2)."""
    t = costs.fwd_compute[0] + costs.bwd_compute[0] + costs.fwd_comm[0] + costs.bwd_comm[0]
    return (micro_batches * vpp + pp - 1) * t


def _run_1f1b(
    costs: BaselineChunkCosts, *, pp: int, vpp: int, micro_batches: int
) -> list[tuple[int, Op, float, float]]:
    """(rank, op, end, compute seconds) per op; each rank runs its order, each op waits for its input."""
    orders = [megatron_order(pp, vpp, micro_batches, r) for r in range(pp)]
    done: dict[tuple[bool, int, int], float] = {}
    free, pos, out = [0.0] * pp, [0] * pp, []
    last = pp * vpp - 1
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            op = orders[r][pos[r]]
            stage = op.chunk * pp + r
            ready = _input_ready(done, op, stage, last, pp, costs.p2p_s)
            if ready is None:
                continue
            layer_chunk = stage
            comp = (costs.fwd_compute if op.forward else costs.bwd_compute)[layer_chunk]
            comm = (costs.fwd_comm if op.forward else costs.bwd_comm)[layer_chunk]
            end = max(free[r], ready) + comp + comm
            done[op.forward, stage, op.micro_batch] = free[r] = end
            out.append((r, op, end, comp))
            pos[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("baseline 1F1B simulation deadlocked; the schedule order is inconsistent")
    return out


def _input_ready(done: dict, op: Op, stage: int, last: int, pp: int, p2p_s: float) -> float | None:
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
