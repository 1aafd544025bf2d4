"""Simulating a shortlisted AF-Pipe candidate (the allocator's step 5), and the exact lower bounds on its step
that let the search skip simulations which cannot change its choice (pure Python).

A candidate is simulated at the ring cap 2p + 1 and at twice that (as far as memory allows), whole and with a split
backward; it keeps the smaller cap and the earlier form unless another is at least 1% faster. Two bounds hold for
every one of those simulations, each a lower bound, never an estimate:

* the roofline T* (``AfPlan.step_time_s`` never goes below it);
* the in-flight bound (``ring_sim.cap_bound_s``): A_0 holds at most ``cap`` micro-batches, each for at least one
  round trip through every layer, so the step is at least ceil(m / cap) round trips. It binds where few micro-batches
  fit in flight (memory) or the transfers make a round trip long (slow links, many layers).

A simulation is skipped only where its bound shows that it cannot be kept (not 1% faster than the plan kept so
far), and a candidate only where no simulation of it could beat the best plan found: the search's choice is the one
simulating everything would make (``tests/test_planner_search_speed.py`` checks it against that path).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from disagmoe_ds.planner.plans import AfCandidate, AfPlan, PlanRequest
from disagmoe_ds.planner.ring_sim import cap_bound_s
from disagmoe_ds.planner.simulate import SimResult, schedule_costs, simulate_af
from disagmoe_ds.planner.task_costs import AfTaskCosts, af_task_costs
from disagmoe_ds.schedule import PipeShape

Memo = dict[tuple[AfCandidate, int], SimResult]
KEEP_MARGIN = 0.99  # another simulation of a candidate is kept only when at least 1% faster


@dataclass(frozen=True)
class Form:
    """One backward form of a candidate: the candidate with it, its task costs and its caps' step bounds."""

    candidate: AfCandidate
    costs: AfTaskCosts
    bounds: dict[int, float]  # cap -> lower bound on the plan's step (with sync and optimizer step)


def caps(c: AfCandidate) -> list[int]:
    """The ring cap 2p + 1 and twice it, as far as memory and the step's micro-batches allow."""
    ring = 2 * c.layout.depth + 1
    return sorted({min(c.max_in_flight, c.micro_batches, k * ring) for k in (1, 2)})


def forms(req: PlanRequest, c: AfCandidate, splits: tuple[bool, ...]) -> list[Form]:
    """``c`` under each backward form in ``splits`` (False: whole, True: split), with its bounds."""
    shape = PipeShape(depth=c.layout.depth, num_layers=req.spec.num_layers, moe_layers=req.spec.moe_layers)
    out = []
    for split in splits:
        cand = replace(c, work=replace(c.work, split_backward=split))
        costs = af_task_costs(req.spec, c.layout, cand.work, placement=c.placement, rates=req.rates, nics=c.nics)
        ring = schedule_costs(req.spec, costs)
        bounds = {  # added up as AfPlan.step_time_s adds them, so that float rounding keeps the bound below it
            cap: max(cap_bound_s(shape, c.micro_batches, ring, cap=cap), c.roofline.bottleneck_s)
            + c.exposed_sync_s
            + c.optimizer_step_s
            for cap in caps(c)
        }
        out.append(Form(cand, costs, bounds))
    return out


def bound_tokens_per_s(c: AfCandidate, shapes: list[Form]) -> float:
    """An upper bound on the tokens per second of any simulated plan of ``c`` (its smallest step bound)."""
    return c.tokens / min(b for form in shapes for b in form.bounds.values())


def simulate_candidate(
    req: PlanRequest,
    c: AfCandidate,
    *,
    exposed_comm: bool = False,
    splits: tuple[bool, ...] = (False,),
    memo: Memo | None = None,
    shapes: list[Form] | None = None,
) -> AfPlan:
    """The plan ``c`` keeps (module docstring), its simulations skipped where a bound shows they cannot be kept.
    ``memo`` keeps simulations (without exposed communication or timeline) for a later call on the same candidate;
    with ``exposed_comm`` only the kept plan is simulated again, with the communication-free run and the timeline
    (the choice reads the step only). ``shapes``: ``forms(req, c, splits)`` where the caller has them."""
    memo = {} if memo is None else memo
    best: AfPlan | None = None
    for form in shapes if shapes is not None else forms(req, c, splits):
        for cap, bound in form.bounds.items():
            if best is not None and bound >= KEEP_MARGIN * best.step_time_s:
                continue  # its step is at least the bound: it would not be kept
            if (form.candidate, cap) not in memo:
                memo[form.candidate, cap] = _simulate(req, form.candidate, form.costs, cap, exposed_comm=False)
            plan = AfPlan(form.candidate, memo[form.candidate, cap], cap)
            if best is None or plan.step_time_s < KEEP_MARGIN * best.step_time_s:
                best = plan
    assert best is not None
    if not exposed_comm:
        return best
    cand = best.candidate
    costs = af_task_costs(req.spec, cand.layout, cand.work, placement=cand.placement, rates=req.rates, nics=cand.nics)
    return AfPlan(cand, _simulate(req, cand, costs, best.in_flight, exposed_comm=True), best.in_flight)


def _simulate(req: PlanRequest, c: AfCandidate, costs: AfTaskCosts, cap: int, *, exposed_comm: bool) -> SimResult:
    """One simulated step of ``c`` at ``cap`` in flight; the timeline only with the exposed communication (the
    reported plan)."""
    return simulate_af(
        req.spec,
        c.layout,
        costs,
        micro_batches=c.micro_batches,
        max_in_flight=cap,
        exposed_comm=exposed_comm,
        events=exposed_comm,
    )
