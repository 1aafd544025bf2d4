"""What does not work beside what: every lever x lever and family x lever rule with its one-line reason, and the one
line a user sees when some fire (pure Python).

A ``Rule`` says that ``lever`` does not work beside ``beside``: another lever, or a family (its ``model_type``).
The rules of one lever beside levers make one ``Line``, and those of one lever beside a family another: a refusal is
that line, naming every lever beside it that fired in the table's order (or the family's reason). Refusing a lever
combination is one ``Rule`` in ``LEVER_RULES``; a family's rules come from its facts (``FamilyFacts.not_with``, and
``bias_update_rate`` where its router has no correction bias), so adding a family adds them.

Where they are checked: the job's preflight checks every lever once (``runtime.rank``, with the job's levers from
``config.levers``); what is known earlier is refused as soon as it is read, through the same table: a section's own
levers (``DisagMoEConfig``), an A-lane's degrees (``models.sequence_parallel``, ``models.tensor_parallel``), the
evaluation flags (``train.checks``) and the balancing rate (``train.balance``).

>>> print(refusals(Job.of("qwen3_next", sequence_parallel=2))[0])
sequence_parallel 2: qwen3_next is not supported: its Gated DeltaNet layers are recurrent over the sequence
>>> [rule.beside for rule in fired(Job.of(None, cuda_graphs=True, split_backward=True, compile=True))]
['split_backward']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from disagmoe_ds.capabilities.facts import FACTS, facts_of
from disagmoe_ds.errors import ConfigError, DisagMoEError, LayoutError

# Every lever a rule may name, with what turns it on (a degree is on above 1, a switch or a rate when set).
LEVERS: dict[str, str] = {
    "activation_checkpointing": '"disagmoe.activation_checkpointing"',
    "selective_recompute": '"disagmoe.selective_recompute"',
    "recompute": '"disagmoe.recompute" (each side\'s recompute)',
    "offload": 'an "offload" share above 0 on either side',
    "offload_ffn": 'an "offload" share above 0 on the expert side',
    "split_backward": '"disagmoe.split_backward"',
    "sequence_parallel": "Ulysses sequence parallelism (a degree above 1)",
    "tensor_parallel": "tensor parallelism (a degree above 1)",
    "cuda_graphs": '"disagmoe.cuda_graphs"',
    "compile": '"disagmoe.compile"',
    "fp8": '"disagmoe.fp8"',
    "lora": 'LoRA adapters ("disagmoe.lora")',
    "capacity_factor": '"disagmoe.capacity_factor"',
    "zero3_attention": "ZeRO-3 on the attention side",
    "zero3_ffn": "ZeRO-3 on the expert side",
    "offload_optimizer": '"zero_optimization.offload_optimizer" or "disagmoe.offload_optimizer"',
    "offload_optimizer_attention": "optimizer offload on the attention side",
    "offload_param": '"zero_optimization.offload_param"',
    "evaluation": "an evaluation (--eval-data or --eval-split)",
    "bias_update_rate": "router bias balancing (--bias-update-rate above 0)",
}
DEGREES = ("sequence_parallel", "tensor_parallel")


@dataclass(frozen=True)
class Job:
    """What the rules read of a job: its family's ``model_type`` (None: not known where it is checked) and the levers
    it turns on, each with its setting (a degree, a rate; True for a switch). A lever not there is off."""

    model_type: str | None = None
    levers: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, model_type: str | None, **settings: float | None) -> Job:
        """The job of the family ``model_type`` (a config.json's or its text model's) with ``settings`` by lever; the
        levers they leave off (a degree of 1, a switch False or None, a rate of 0) are dropped."""
        unknown = sorted(set(settings) - set(LEVERS))
        if unknown:
            raise KeyError(f"no lever {', '.join(unknown)} in capabilities.rules.LEVERS")
        facts = facts_of(model_type)
        on = {k: v for k, v in settings.items() if v is not None and (v > 1 if k in DEGREES else bool(v))}
        return cls(model_type if facts is None else facts.model_type, on)


@dataclass(frozen=True)
class Rule:
    """``lever`` does not work beside ``beside`` (a lever, or a family's ``model_type``) because ``why``; ``label``
    names ``beside`` in its lever's line."""

    lever: str
    beside: str
    why: str
    label: str = ""

    @property
    def by_family(self) -> bool:
        return self.beside in FACTS

    def fires(self, job: Job) -> bool:
        return self.lever in job.levers and (self.beside == job.model_type or self.beside in job.levers)


@dataclass(frozen=True)
class Line:
    """The one line refusing ``lever`` beside levers (``by_family`` False) or beside a family, as ``error``; ``text``
    writes it from the job and the rules that fired."""

    lever: str
    by_family: bool
    error: type[DisagMoEError]
    text: Callable[[Job, Sequence[Rule]], str]


def _labels(rules: Sequence[Rule]) -> str:
    return ", ".join(rule.label for rule in rules)


def _family_line(lever: str) -> Callable[[Job, Sequence[Rule]], str]:
    return lambda job, rules: f"{lever} {job.levers[lever]}: {job.model_type} is not supported: {rules[0].why}"


_GRAPH = "a graph replays a part's forward and backward whole, with its activations in a pool of its own"
_TP_FIX = "change that or use sequence_parallel for the attention side"
_ZERO2_FIX = '("disagmoe": {"zero_stage": {"ffn": 2}})'
# In the order a preflight refuses them: the first line that fires is the one the user sees.
LINES: tuple[Line, ...] = (
    Line("selective_recompute", False, ConfigError, lambda job, rules: (
        '"disagmoe.selective_recompute" and "disagmoe.activation_checkpointing" are exclusive: the latter already '
        "recomputes every activation of a chunk; set one of them")),
    Line("recompute", False, ConfigError, lambda job, rules: (
        f'"disagmoe.recompute" sets each side\'s recompute and replaces {_labels(rules)}, which set both sides\'; '
        "use one of them")),
    Line("cuda_graphs", False, ConfigError, lambda job, rules: (
        f'"disagmoe.cuda_graphs" does not work with {_labels(rules)}: {_GRAPH}; turn one of them off')),
    Line("capacity_factor", False, ConfigError, lambda job, rules: (
        '"disagmoe.capacity_factor" runs a step again when it outgrows the capacity, which drops the step\'s '
        "gradients first; that is not done for ZeRO-3 on the expert side or for optimizer offload yet: remove "
        '"capacity_factor" (messages then carry their sizes in headers) or use ZeRO 0-2 without offload')),
    Line("offload_optimizer", False, ConfigError, lambda job, rules: (
        f"optimizer offload (\"zero_optimization.offload_optimizer\" or \"disagmoe.offload_optimizer\") does not "
        f"work with {_labels(rules)} in the disaggregated mode yet: "
        f"{rules[0].why}; use ZeRO stage 1 with it (per side: \"disagmoe\": {{\"zero_stage\": "
        '{"attention": 1, "ffn": 1}}) or drop the offload')),
    Line("zero3_ffn", False, ConfigError, lambda job, rules: (
        f"ZeRO-3 on the expert side does not work with {_labels(rules)} yet; turn "
        f"{'it' if len(rules) == 1 else 'them'} off or use ZeRO stage 2 there {_ZERO2_FIX}")),
    Line("sequence_parallel", True, LayoutError, _family_line("sequence_parallel")),
    Line("tensor_parallel", True, LayoutError, _family_line("tensor_parallel")),
    Line("tensor_parallel", False, ConfigError, lambda job, rules: (
        f'tensor_parallel {job.levers["tensor_parallel"]} does not work with {_labels(rules)} yet; '
        f"{_TP_FIX}")),
    Line("cuda_graphs", True, ConfigError, lambda job, rules: (
        f'"cuda_graphs" does not work with the {job.model_type} model yet: {rules[0].why}; turn it off')),
    Line("evaluation", False, ConfigError, lambda job, rules: (
        'an evaluation with "cuda_graphs" is not supported yet; drop --cuda-graphs or the eval flags')),
    Line("fp8", True, ConfigError, lambda job, rules: (
        f'"disagmoe.fp8" does not work with the {job.model_type} model yet: {rules[0].why}; turn it off')),
    Line("bias_update_rate", True, ConfigError, lambda job, rules: (
        f"--bias-update-rate {job.levers['bias_update_rate']}: model_type {job.model_type!r} has no router "
        "correction bias (only DeepSeek-V3 style routers do); balance it with its aux loss (router_aux_loss_coef) "
        "or pass 0")),
)  # fmt: skip

_SAVED = "it moves or rebuilds a part's saved tensors, which a graph keeps at fixed addresses"
_ZERO3 = "ZeRO-3 gathers an expert shard's parameters in module hooks around each forward and backward"
_PER_SIDE = "the per-side key says what each side rebuilds"
_RERUN = "a step that outgrew the capacity runs again after its gradients are dropped, which is not done there yet"
LEVER_RULES: tuple[Rule, ...] = (
    Rule("selective_recompute", "activation_checkpointing", "full recompute already rebuilds every activation"),
    Rule("recompute", "activation_checkpointing", _PER_SIDE, '"disagmoe.activation_checkpointing"'),
    Rule("recompute", "selective_recompute", _PER_SIDE, '"disagmoe.selective_recompute"'),
    Rule("cuda_graphs", "recompute", _SAVED, '"disagmoe.recompute"'),
    Rule("cuda_graphs", "activation_checkpointing", _SAVED, '"disagmoe.activation_checkpointing"'),
    Rule("cuda_graphs", "selective_recompute", _SAVED, '"disagmoe.selective_recompute"'),
    Rule("cuda_graphs", "offload", _SAVED, '"disagmoe.offload"'),
    Rule("cuda_graphs", "split_backward", "a graph replays a part's backward whole", '"disagmoe.split_backward"'),
    Rule("cuda_graphs", "sequence_parallel", "the head takes the slice's shifted labels",
         '"disagmoe.sequence_parallel"'),
    Rule("cuda_graphs", "tensor_parallel", "the shards gather and reduce-scatter inside the parts",
         '"disagmoe.tensor_parallel"'),
    Rule("capacity_factor", "zero3_ffn", _RERUN, "ZeRO-3 on the expert side"),
    Rule("capacity_factor", "offload_optimizer", _RERUN, "optimizer offload"),
    Rule("zero3_ffn", "compile", f"{_ZERO3}, which compile would trace through", "compile"),
    Rule("zero3_ffn", "cuda_graphs", f"{_ZERO3}, which a captured graph cannot run", "cuda_graphs"),
    Rule("zero3_ffn", "offload_ffn", f"{_ZERO3}; offload would copy the gathered parameters to host memory",
         'offload {"ffn": > 0}'),
    Rule("zero3_ffn", "offload_param", "not tested with DeepSpeed's parameter offload",
         "zero_optimization.offload_param"),
    Rule("zero3_ffn", "offload_optimizer", "not tested with DeepSpeed's optimizer offload",
         "optimizer offload (zero_optimization.offload_optimizer or disagmoe.offload_optimizer)"),
    Rule("tensor_parallel", "zero3_attention", "the shards' gathers would meet ZeRO-3's, not built yet",
         "ZeRO stage 3 on the attention side"),
    Rule("tensor_parallel", "lora", "adapters are not cut into shards yet", "lora"),
    Rule("tensor_parallel", "offload_optimizer_attention",
         "the TP sum of replicated gradients runs on the device's copies",
         "optimizer offload on the attention side (zero_optimization.offload_optimizer or "
         "disagmoe.offload_optimizer.attention)"),
    Rule("evaluation", "cuda_graphs", "the graphs are captured for training steps, with their backward"),
)  # fmt: skip


def family_rules() -> tuple[Rule, ...]:
    """Every family x lever rule, from the families' facts."""
    rules = [Rule(lever, f.model_type, why) for f in FACTS.values() for lever, why in f.not_with]
    rules += [
        Rule("bias_update_rate", f.model_type, "its router has no correction bias to update")
        for f in FACTS.values()
        if f.expert_bias_path is None
    ]
    return tuple(rules)


RULES: tuple[Rule, ...] = (*LEVER_RULES, *family_rules())


def fired(job: Job) -> list[Rule]:
    """The rules ``job`` breaks, in the table's order."""
    return [rule for rule in RULES if rule.fires(job)]


def refusals(job: Job) -> list[DisagMoEError]:
    """One error per line that ``job`` breaks, in ``LINES``' order (empty: every lever may run together)."""
    broken = fired(job)
    errors = []
    for line in LINES:
        rules = [r for r in broken if r.lever == line.lever and r.by_family == line.by_family]
        if rules:
            errors.append(line.error(line.text(job, rules)))
    return errors


def check(job: Job) -> None:
    """Refuse ``job`` with the first line it breaks."""
    errors = refusals(job)
    if errors:
        raise errors[0]
