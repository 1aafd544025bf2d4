"""The evaluation loss on held-out data: after which steps a run evaluates, and one evaluation.

The held-out samples are ``--eval-data``'s or ``--eval-split``'s (``train.data``). Every evaluation runs the same
batches (``data.HeldOutBatches``: the first ``--eval-steps`` of them, or all) through the executor's ``eval_batch``:
the step's forwards alone, without autograd, changing nothing a training step reads, so training continues bit for
bit as it would without them. The loss is HF's LM loss (no aux loss) averaged over every labelled token of those
batches, so it depends on the weights and the held-out data alone: not on the layout, the mode or a resume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from disagmoe_ds.checkpoint.resume import ResumePoint
from disagmoe_ds.data import HeldOutBatches
from disagmoe_ds.data.loader import to_device
from disagmoe_ds.runtime.rank import RankRuntime
from disagmoe_ds.train.args import TrainArgs
from disagmoe_ds.train.data import TrainData, eval_batches


def is_eval_step(args: TrainArgs, step: int) -> bool:
    """Evaluate after ``step``: every ``--eval-every`` steps and after the run's last, when there is held-out data."""
    return args.evaluates and (step == args.steps or (args.eval_every > 0 and step % args.eval_every == 0))


@dataclass(frozen=True)
class EvalLoss:
    """One evaluation, identical on every rank."""

    loss: float  # mean LM loss over the held-out tokens
    tokens: int
    batches: int

    def __str__(self) -> str:
        batches = f"{self.batches} batch" + ("es" if self.batches != 1 else "")
        return f"eval loss {self.loss:.4f} over {self.tokens:,} held-out tokens ({batches})"


class Evaluator:
    """One rank's evaluations; ``batches``: its lane's, None on a rank that reads no data. Building it and calling it
    are collective: every rank runs the same number of batches, in the same order."""

    def __init__(self, runtime: RankRuntime, batches: HeldOutBatches | None, device: torch.device) -> None:
        self.runtime, self.batches, self.device = runtime, batches, device
        count = torch.tensor(len(batches) if batches is not None else 0, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)  # the ranks that read no data learn it from those that do
        self.count = int(count.item())

    def __call__(self) -> EvalLoss:
        total, tokens = 0.0, 0
        for index in range(self.count):
            batches = to_device(self.batches[index], self.device) if self.batches is not None else None
            result = self.runtime.executor.eval_batch(batches)
            total, tokens = total + result.lm_loss_sum, tokens + result.tokens
        return EvalLoss(total / tokens, tokens, self.count)


def weights_of(args: TrainArgs, resume: ResumePoint | None) -> str:
    """What ``--eval-only`` evaluates: the resumed checkpoint, else the ``--init-from`` directory."""
    return f"checkpoint {resume.path} at step {resume.step}" if resume is not None else str(args.model)


def describe(args: TrainArgs, data: TrainData) -> str:
    """The start banner's line: the held-out data, when the run evaluates and over how many batches and tokens."""
    assert data.held_out is not None, "only a run with held-out data evaluates"
    batches = eval_batches(data, args, lane=0)
    if args.eval_only:
        when = "once, nothing trained"
    elif args.eval_every:
        when = f"every {args.eval_every} steps and after the last" if args.eval_every > 1 else "after every step"
    else:
        when = "after the last step (--eval-every N: every N steps)"
    return (
        f"eval: {data.held_out_summary}; {when}: the mean LM loss over {len(batches)} batch"
        f"{'es' if len(batches) != 1 else ''} of {args.sequences_per_step} sequences ({batches.tokens():,} labelled "
        "tokens)"
    )
