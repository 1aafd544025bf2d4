"""The typed sections of the ``"disagmoe"`` section: each a small frozen dataclass with one concept that checks its
own keys."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from disagmoe_ds.config.zero import SECTION, ZERO_STAGES, effective_zero_stage
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.fp8.shapes import BF16_WIDTH, EXPERT_BF16_WIDTH
from disagmoe_ds.layout import Layout, RankCounts
from disagmoe_ds.models.attention_kernel import ATTENTION_KERNELS
from disagmoe_ds.models.lora_settings import LoraSettings

# The keys of comm.transport.TRANSPORTS (a test holds them equal): named here so that reading a config loads no torch.
TRANSPORT_NAMES = ("auto", "rendezvous")
# The keys of planner.cluster.PRESETS (a test holds them equal): named here so that reading a config loads no planner.
CLUSTER_PRESETS = ("h800", "h100", "h200", "a100")
SIDES = ("attention", "ffn")  # the keys of the per-side settings (recompute, offload, zero_stage)
RECOMPUTE = ("none", "selective", "full")  # what a side rebuilds in backward (the planner's recompute policies)


# ----- the typed sections -----
@dataclass(frozen=True, kw_only=True)
class Section:
    """A typed group of a config's keys. ``__post_init__`` runs the ``_check`` of every section a config is composed
    of once, bases first, then the config's own (the rules across sections)."""

    def __post_init__(self) -> None:
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("_check")
            if check is not None:
                check(self)

    def _named(self, key: str) -> str:
        """How a message names ``key`` (the co-located config names its own)."""
        return f'"{SECTION}.{key}"'

    def _positive(self, key: str, kind: type, *, optional: bool = False) -> None:
        value = getattr(self, key)
        if optional and value is None:
            return
        allowed = (int, float) if kind is float else (int,)
        if isinstance(value, bool) or not isinstance(value, allowed) or value <= 0:
            raise ConfigError(f"{self._named(key)} must be a positive {kind.__name__}, got {value!r}")

    def _switches(self, *keys: str) -> None:
        for key in keys:
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{self._named(key)} must be true or false, got {getattr(self, key)!r}")


@dataclass(frozen=True, kw_only=True)
class LaneSlices(Section):
    """How many lanes of an A-group hold one micro-batch in slices, and how: s x t of them (s TP groups of t).

    Attributes:
        sequence_parallel: s, ranks of an A-group that hold one micro-batch's sequence in slices (DeepSpeed-Ulysses
            around the attention core, ``models.sequence_parallel``); s lanes form one SP group (consecutive ones
            without tensor parallelism), so an A-group's lanes / (s t) groups train distinct micro-batches.
        tensor_parallel: t, ranks of an A-group that hold one micro-batch's sequence in slices and every attention
            module's heads and gated MLP's columns in shards (Megatron-style tensor parallel with sequence parallel,
            ``models.tensor_parallel``): t consecutive lanes form one TP group.
    """

    sequence_parallel: int = 1
    tensor_parallel: int = 1

    def _check(self) -> None:
        for key in ("sequence_parallel", "tensor_parallel"):
            self._positive(key, int)


@dataclass(frozen=True, kw_only=True)
class LayoutCounts(LaneSlices, RankCounts):
    """How many ranks do what (``world_size`` and ``lanes`` as ``layout.RankCounts`` derives them), and the
    lanes' slicing (``LaneSlices``).

    Attributes:
        attention_gpus: M, attention ranks in total.
        ffn_gpus: N, FFN (expert) ranks in total.
        depth: p, A-groups (= F-groups); group g owns layers g, g+p, ...
        expert_data_parallel: replicas of each expert shard inside an F-group.
        node_dedup: consecutive expert ranks (one node's) that share one message of a lane: a token crosses the
            network once per node and fans out inside it (``layout.Layout``); 1: a message per expert rank.
    """

    attention_gpus: int = 1
    ffn_gpus: int = 1
    depth: int = 1
    expert_data_parallel: int = 1
    node_dedup: int = 1

    def _check(self) -> None:
        for key in ("attention_gpus", "ffn_gpus", "depth", "expert_data_parallel", "node_dedup"):
            self._positive(key, int)

    def layout(self, *, num_layers: int, num_experts: int) -> Layout:
        counts = {f.name: getattr(self, f.name) for f in fields(LayoutCounts)}  # with the lanes' slicing
        return Layout(num_layers=num_layers, num_experts=num_experts, **counts)


@dataclass(frozen=True, kw_only=True)
class Accumulation(Section):
    """What one optimizer step consumes (both modes).

    Attributes:
        micro_batches: micro-batches per optimizer step per lane (DeepSpeed's gradient_accumulation_steps).
    """

    micro_batches: int = 1

    def _check(self) -> None:
        self._positive("micro_batches", int)


@dataclass(frozen=True, kw_only=True)
class Pipeline(Section):
    """How the AF-Pipe schedule orders a step's tasks.

    Attributes:
        max_in_flight: cap on micro-batches in flight per worker (memory); None lets the schedule choose.
        split_backward: each backward computes the input gradients its upstream peer waits for, and defers the weight
            gradients to a task of their own that the schedule runs when the worker would idle (the planner's "split
            backward" variant, the zero-bubble idea on the A/F ring).
    """

    max_in_flight: int | None = None
    split_backward: bool = False

    def _check(self) -> None:
        self._positive("max_in_flight", int, optional=True)
        self._switches("split_backward")


@dataclass(frozen=True, kw_only=True)
class Watchdog(Section):
    """When a rank stops waiting (both modes).

    Attributes:
        comm_timeout_s: a rank waiting longer than this for a peer fails the job instead of hanging; a step
            stalled for half of it prints the rank's Python stacks first (``launch.watchdog``).
    """

    comm_timeout_s: float = 300.0

    def _check(self) -> None:
        self._positive("comm_timeout_s", float)


@dataclass(frozen=True, kw_only=True)
class Exchange(Section):
    """How the A/F exchanges move their payloads.

    Attributes:
        comm_stream: on GPUs, allocate and post the exchanges' receives on a side CUDA stream, so that a receive
            posted ahead starts at once instead of after the compute queued before it (``comm.channel.CommStream``).
        transport: ``auto`` is torch.distributed's backend (NCCL on GPUs, gloo on CPUs); ``rendezvous`` is a CPU
            stand-in for NCCL's network transport that tests run under, where a send completes only once its receive
            has started (``comm.transport``).
        capacity_factor: with several ep ranks, every m2n message has a fixed capacity, the rows and routed pairs a
            lane sends one ep rank under balanced routing times this factor (``comm.routing.Capacity``): no header,
            one communicator call per message, and no receive waits for its sizes. Exact, never dropping: a step in
            which some message outgrew the capacity is discarded and run again at a capacity grown to what it needed
            (times the factor), logged. None: exact sizes, sent ahead in a header per message. One ep rank has fixed
            sizes anyway.
    """

    comm_stream: bool = True
    transport: str = "auto"
    capacity_factor: float | None = None

    def _check(self) -> None:
        self._switches("comm_stream")
        if self.transport not in TRANSPORT_NAMES:
            raise ConfigError(
                f"{self._named('transport')} must be one of {list(TRANSPORT_NAMES)}, got {self.transport!r}"
            )
        self._positive("capacity_factor", float, optional=True)


@dataclass(frozen=True, kw_only=True)
class Fp8Compute(Section):
    """Which GEMMs compute in FP8 (both modes).

    Attributes:
        fp8: the routed experts' grouped GEMMs and the attention side's projections (attention, dense and shared
            MLPs; not the router, not the LM head) in FP8 with rowwise power-of-two scales, forward and both backward
            GEMMs (``disagmoe_ds.fp8``); weights, gradients and optimizer state keep their dtype. On CUDA torch's FP8
            kernels, elsewhere an exact emulation. Each routed expert's weight is cast to FP8 once per optimizer step
            and its two FP8 copies kept for the step (``fp8.weight_cache``: 2 bytes a parameter), unless
            ``fp8_cast_per_call``; linear layers cast theirs in every call.
        fp8_cast_per_call: with ``fp8``, cast the expert weights in every call instead (an HBM pass over them per
            micro-batch and pass; no copies kept), for a rank whose memory has no room for the step's copies.
        fp8_bf16_width: with ``fp8``, the attention side's projections whose input or output width (of the whole
            projection, not a TP shard) is at most this stay in the model's dtype, where FP8's quantizations cost
            more than its GEMM saves (``fp8.shapes``: 2,048 by default, a rule measured at one shape); 0: every
            aligned projection in FP8. The planner prices the same.
        fp8_expert_bf16_width: with ``fp8``, the routed experts keep bf16 grouped GEMMs where their harmonic width
            ``H I / (H + I)`` is at most this (``fp8.shapes.experts_fp8_pay``: 1,536 by default, between the widths
            where FP8 was measured losing and paying; Qwen3-30B-A3B's experts stay bf16, DeepSeek-V3's and
            Mixtral's run FP8); 0: always FP8. The routed tokens travel in FP8 either way. The planner prices the
            same.
    """

    fp8: bool = False
    fp8_cast_per_call: bool = False
    fp8_bf16_width: int = BF16_WIDTH
    fp8_expert_bf16_width: int = EXPERT_BF16_WIDTH

    def _check(self) -> None:
        self._switches("fp8", "fp8_cast_per_call")
        for key in ("fp8_bf16_width", "fp8_expert_bf16_width"):
            width = getattr(self, key)
            if isinstance(width, bool) or not isinstance(width, int) or width < 0:
                raise ConfigError(f"{self._named(key)} must be a width >= 0, got {width!r}")

    @property
    def fp8_cast_once(self) -> bool:
        """The FP8 weights are cast once per optimizer step (``fp8.weight_cache``)."""
        return self.fp8 and not self.fp8_cast_per_call


@dataclass(frozen=True, kw_only=True)
class Kernels(Fp8Compute):
    """How the parts run on a GPU (both modes; ``compile`` and ``cuda_graphs`` CUDA only), FP8 among it
    (``Fp8Compute``).

    Attributes:
        compile: fuse the attention parts and the experts' elementwise work with ``torch.compile``.
        cuda_graphs: replay every attention part, the head and (with one ep rank or, disaggregated, a
            ``capacity_factor``, whose messages have fixed rows) every expert shard as CUDA graphs, one launch per
            forward and per backward, so the host no longer holds the GPU back at small micro-batches
            (``models.graphs``). Costs memory: each part keeps the activations of as many micro-batches as the
            schedule has in flight for it, in pools of its own.
        attention: HF's attention function the attention parts run (``models.attention_kernel``): ``"auto"`` (HF's
            own choice, SDPA where the model has it; on CUDA flex_attention where HF would run eager, as for
            GPT-OSS's sinks), or ``"eager"``, ``"sdpa"``, ``"flex_attention"`` where the model's HF class runs it.
    """

    compile: bool = False
    cuda_graphs: bool = False
    attention: str = "auto"

    def _check(self) -> None:
        self._switches("compile", "cuda_graphs")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(
                f"{self._named('attention')} must be one of {list(ATTENTION_KERNELS)}, got {self.attention!r}"
            )


@dataclass(frozen=True, kw_only=True)
class Recompute(Section):
    """What a rank rebuilds of a micro-batch in its backward instead of keeping it (both modes; the planner's
    recompute policies).

    Attributes:
        activation_checkpointing: keep only each chunk's inputs and recompute its activations in backward
            (attention parts and expert shards), trading compute for the memory of micro-batches in flight.
        selective_recompute: drop only the large, cheap-to-rebuild activations (attention blocks, shared/dense
            SwiGLUs, the routed experts' gate/up outputs) and rebuild them in backward (``models.recompute``; the
            planner's "recompute selective"). Exclusive with ``activation_checkpointing``, which drops more.
        recompute: per side (``attention``, ``ffn``), ``"none"``, ``"selective"`` or ``"full"``: the two switches
            above for one side alone (the side's memory and compute differ: say, the attention side keeping its
            activations and the expert side rebuilding them); a side left out recomputes nothing. Replaces them.
            Co-located, the sides are a rank's attention parts and its expert shards.
    """

    activation_checkpointing: bool = False
    selective_recompute: bool = False
    recompute: dict[str, str] = field(default_factory=dict)

    def _check(self) -> None:
        self._switches("activation_checkpointing", "selective_recompute")  # exclusive: capabilities.rules
        _check_per_side("recompute", self.recompute, '{"attention": "none", "ffn": "full"}', _recompute_problem)

    def recompute_of(self, side: str) -> str:
        """What the ``attention`` or ``ffn`` side rebuilds in backward: ``"none"``, ``"selective"`` or ``"full"``."""
        if self.recompute:
            return self.recompute.get(side, "none")
        return "full" if self.activation_checkpointing else "selective" if self.selective_recompute else "none"


@dataclass(frozen=True, kw_only=True)
class MemoryLevers(Recompute):
    """What an AF-Pipe worker keeps of a micro-batch between its forward and its backward (the planner's memory
    variants): ``Recompute``'s policies, and

    Attributes:
        resend: the expert side keeps nothing between a micro-batch's forward and backward: the attention side
            sends the routed tokens again with the backward's gradients, and the expert side recomputes its
            forward from them (the planner's "resend" variant: F memory for A->F bytes). With p > 1 the rank that
            sends those gradients (A_next) gets the tokens with the residual hand-off and keeps them until then.
        offload: per side (``attention``, ``ffn``), the share in [0, 1] of each micro-batch's layers whose saved
            activations wait for their backward in host memory (the planner's "offload" variant; ``afpipe.offload``).
    """

    resend: bool = False
    offload: dict[str, float] = field(default_factory=dict)

    def _check(self) -> None:  # Recompute's own runs too (Section.__post_init__ runs each class's)
        self._switches("resend")
        _check_per_side("offload", self.offload, '{"attention": 0.5, "ffn": 0.0}', _offload_problem)

    def offload_share(self, side: str) -> float:
        """The offload share of the ``attention`` or ``ffn`` side (0.0 where the section leaves it out)."""
        return float(self.offload.get(side, 0.0))


@dataclass(frozen=True, kw_only=True)
class ZeroPerSide(Section):
    """Each side's ZeRO stage (the planner's "ZeRO a/f") and where its optimizer state lives.

    Attributes:
        zero_stage: per side (``attention``, ``ffn``), the ZeRO stage of that side's engines, replacing
            ``zero_optimization.stage`` there; the expert side also takes stage 3 (its parameters sharded over the
            expert replicas).
        offload_optimizer: per side, true: DeepSpeed's ZeRO-Offload for that side's engines (the fp32 master
            weights, the Adam moments and the step in host memory, ``zero_optimization.offload_optimizer`` with
            device cpu), false: none, replacing the ds_config's ``offload_optimizer`` there. The expert side holds
            most of a large MoE model's parameters and the attention side most of its activations: this moves the
            former's 12 bytes a parameter to the host and keeps the latter's step on the GPU. ZeRO 1 or 2 there.
    """

    zero_stage: dict[str, int] = field(default_factory=dict)
    offload_optimizer: dict[str, bool] = field(default_factory=dict)

    def _check(self) -> None:
        _check_per_side("zero_stage", self.zero_stage, '{"attention": 1, "ffn": 2}', _zero_stage_problem)
        _check_per_side("offload_optimizer", self.offload_optimizer, '{"ffn": true}', _switch_problem)

    def offload_optimizer_of(self, side: str, ds_config: dict[str, Any]) -> bool:
        """Whether the ``attention`` or ``ffn`` side's engines keep their optimizer on the host: the per-side
        switch, else whether ``zero_optimization.offload_optimizer`` is set."""
        on = self.offload_optimizer.get(side, bool(ds_config.get("zero_optimization", {}).get("offload_optimizer")))
        if on and self.zero_stage_of(side, ds_config) == 0:
            raise ConfigError(
                f"ZeRO-Offload of the {'expert' if side == 'ffn' else 'attention'} side's optimizer needs ZeRO stage 1 "
                f'or 2 there: set "{SECTION}.zero_stage.{side}" (or "zero_optimization.stage") to 1 or 2'
            )
        return on

    def zero_stage_of(self, side: str, ds_config: dict[str, Any]) -> int:
        """The ZeRO stage of the ``attention`` or ``ffn`` side's engines under ``ds_config``: its per-side stage,
        else ``zero_optimization.stage``; refused with the fix where those engines cannot run it."""
        return effective_zero_stage(ds_config, side, self.zero_stage.get(side))

    def zero_stages(self, ds_config: dict[str, Any]) -> dict[str, int]:
        """``zero_stage_of`` both sides."""
        return {side: self.zero_stage_of(side, ds_config) for side in SIDES}

    @property
    def experts_sharded(self) -> bool:
        """ZeRO-3 on the expert side, which only its per-side stage sets (``effective_zero_stage`` refuses 3 as the
        ds_config's stage): known without the ds_config, as the schedule's costs need it."""
        return self.zero_stage.get("ffn") == 3


@dataclass(frozen=True, kw_only=True)
class CostModel(Section):
    """What the schedule generator's task costs assume.

    Attributes:
        cluster: a planner preset (``h800``, ``h100``, ``h200``, ``a100``) or a cluster JSON (``docs/planner.md``), so
            the order it emits is the one the planner simulated; on a fleet of two GPU types, the attention side's.
        ffn_cluster: the expert side's GPU type where it differs (``disagmoe-plan fleet``): its tasks are priced on
            it; None: ``cluster``. A hostfile whose hosts carry ``gpu=TYPE`` is checked against both before launch.
        profile: a ``disagmoe-plan profile`` JSON whose measured part times replace peak x efficiency there.
    """

    cluster: str = "h200"
    ffn_cluster: str | None = None
    profile: str | None = None

    def _check(self) -> None:
        for key in ("cluster", "ffn_cluster"):
            value = getattr(self, key)
            if value is not None and value not in CLUSTER_PRESETS and not Path(value).is_file():
                raise ConfigError(
                    f"{self._named(key)} must be one of the presets {sorted(CLUSTER_PRESETS)} or a cluster JSON "
                    f"file; {value!r} is neither"
                )
        if self.profile is not None and not Path(self.profile).is_file():
            raise ConfigError(
                f"{self._named('profile')} {self.profile!r} is not a file; write one with disagmoe-plan profile"
            )
        if self.profile is not None and self.ffn_cluster not in (None, self.cluster):
            raise ConfigError(
                f"{self._named('profile')} measures one GPU type, but {self._named('ffn_cluster')} gives the experts "
                "another; drop the profile (each side is then priced on its own type's peak rates)"
            )

    @property
    def side_clusters(self) -> tuple[str, str]:
        """The attention side's and the expert side's cluster."""
        return self.cluster, self.ffn_cluster or self.cluster


@dataclass(frozen=True, kw_only=True)
class Colocation(Section):
    """Whether ``run_pretrain.py`` runs the job co-located, so that one ds_config file says which mode it is for.

    Attributes:
        colocated: ``{"world_size": W, "ep_size": E, "pp_size": P, "virtual_stages": v, "stage_layers": [...],
            "sequence_parallel": s, "tensor_parallel": t}`` (each key optional): run the job co-located, EP+DP in P
            pipeline stages of v chunks, s x t ranks of a stage holding a micro-batch in slices, as ``--mode
            colocated --world-size W --ep-size E --pp-size P --virtual-stages v --stage-layers ...
            --sequence-parallel s --tensor-parallel t`` would (those flags override it); the disaggregated layout
            keys are then not used. None: the mode is ``--mode``'s (disaggregated by default).
    """

    colocated: dict[str, Any] | None = None

    def _check(self) -> None:
        if self.colocated is None:
            return
        if not isinstance(self.colocated, dict):
            raise ConfigError(f'"{SECTION}.colocated" must be an object like {{"world_size": 8, "ep_size": 8}}, '
                              f"got {self.colocated!r}")  # fmt: skip
        known = ("world_size", "ep_size", "pp_size", "virtual_stages", "stage_layers", "sequence_parallel",
                 "tensor_parallel")  # fmt: skip
        unknown = sorted(map(str, set(self.colocated) - set(known)))
        if unknown:  # the values are ColocatedConfig's, checked there
            raise ConfigError(f'unknown key(s) in "{SECTION}.colocated": {", ".join(unknown)}; known: '
                              f"{', '.join(known)}")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class FineTuning(Section):
    """What trains (both modes).

    Attributes:
        lora: LoRA fine-tuning (``models.lora_settings.LoraSettings``: rank, alpha, dropout, targets, train_router):
            adapters on both sides, every base weight frozen; None: every parameter trains.
    """

    lora: LoraSettings | None = None

    def _check(self) -> None:
        if self.lora is not None:  # the JSON object, parsed (and checked) into its settings
            object.__setattr__(self, "lora", LoraSettings.from_dict(self.lora))


def _check_per_side(key: str, value: Any, example: str, problem: Callable[[str, Any], str | None]) -> None:
    """A per-side object (``{"attention": ..., "ffn": ...}``): its type, its keys and each side's value (``problem``
    says what is wrong with one, or None)."""
    if not isinstance(value, dict):
        raise ConfigError(f'"{SECTION}.{key}" must be an object like {example}, got {value!r}')
    unknown = sorted(map(str, set(value) - set(SIDES)))
    if unknown:
        raise ConfigError(f'unknown key(s) in "{SECTION}.{key}": {", ".join(unknown)}; known: attention, ffn')
    for side, item in value.items():
        wrong = problem(side, item)
        if wrong:
            raise ConfigError(f'"{SECTION}.{key}.{side}" {wrong}')


def _recompute_problem(side: str, policy: Any) -> str | None:
    return None if policy in RECOMPUTE else f"must be one of {list(RECOMPUTE)}, got {policy!r}"


def _offload_problem(side: str, share: Any) -> str | None:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        return f"is the share of layers offloaded to host memory, in [0, 1]; got {share!r}"
    return None


def _switch_problem(side: str, value: Any) -> str | None:
    del side
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


def _zero_stage_problem(side: str, stage: Any) -> str | None:
    if isinstance(stage, bool) or stage not in ZERO_STAGES[side]:
        hint = " (ZeRO-3 shards parameters on the expert side only)" if side == "attention" and stage == 3 else ""
        return f"must be one of {list(ZERO_STAGES[side])}, got {stage!r}{hint}"
    return None
