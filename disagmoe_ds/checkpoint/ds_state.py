"""The only code that reads or writes DeepSpeed's optimizer internals: a rank's training state by HF name.

``rank_share`` reads one rank's module weights, fp32 masters, optimizer moments and scalars under HF names (each
tensor from the one rank whose copy is read; expert slices are rows of HF's fused expert tensors); ``join_pieces``
assembles the ranks' shares into whole tensors (``gather_state``: the job's whole ``TrainState``);
``set_rank_state`` writes such a state into a freshly built rank of any layout. ``disagmoe-convert`` (re-layout,
HF export) and ``--export-hf`` build on this.

ZeRO 1/2 keep a parameter's master and moments as fragments of flat per-rank partitions
(``single_partition_of_fp32_groups``), at the parameter's ``_hp_mapping`` fragment: the addresses
``deepspeed.utils.safe_get_full_fp32_param`` uses. DeepSpeed's ``safe_*_optimizer_state`` helpers cannot be used
because they need the state fragments that only ``step()`` links, and a freshly built engine has no optimizer state
to write into. ZeRO 0 keeps master and moments per parameter. ZeRO-3 (an expert side) shards the module weights too:
they are read inside ``gathered``, and a parameter's master and moments are its rows of the flat partitions
``fp32_partitioned_groups_flat`` at ``grad_position`` (what ``get_full_hp_param`` reads), padded at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.fp8.frozen import held_values
from disagmoe_ds.layout import Layout
from disagmoe_ds.models.naming import attention_name_to_hf, expert_name_to_hf
from disagmoe_ds.models.parts import ExpertStage
from disagmoe_ds.models.tensor_parallel import Shard, shard_of

Weights = Literal["module", "master"]  # what an HF export holds / what a re-layout carries
# HF name -> (first expert of the rows it holds, tensor), or for an attention-head shard (tensor parallel)
# (its TP rank, tensor, the dim it is cut along)
Pieces = dict[str, tuple]


@dataclass
class TrainState:
    """A job's training state without its layout, by HF in-memory name.

    ``params`` are the module weights (``weights="module"``) or the fp32 masters (``weights="master"``).
    ``moments`` is empty before the first optimizer step.
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # key -> HF name -> tensor
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. Adam's step, one value for all params
    hyper: dict[str, Any] = field(default_factory=dict)  # optimizer param-group values (the scheduled lr, ...)
    scheduler: dict[str, Any] | None = None
    counters: dict[str, int] = field(default_factory=dict)
    client_state: dict[str, Any] = field(default_factory=dict)


def join_pieces(pieces_by_rank: list[Pieces]) -> dict[str, torch.Tensor]:
    """Full HF tensors: attention tensors as they are, expert slices concatenated by first expert id, head shards
    by TP rank along their dim."""
    merged: dict[str, list[tuple]] = {}
    for pieces in pieces_by_rank:
        for name, piece in pieces.items():
            merged.setdefault(name, []).append(piece)
    return {name: _joined(parts) for name, parts in merged.items()}


def _joined(parts: list[tuple]) -> torch.Tensor:
    dim = parts[0][2] if len(parts[0]) == 3 else 0
    return torch.cat([piece[1] for piece in sorted(parts, key=lambda piece: piece[0])], dim=dim)


def one_scalar_set(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The optimizer scalars shared by every parameter (Adam's step); every engine must agree on them."""
    first = per_rank[0]
    for scalars in per_rank[1:]:
        if scalars.keys() != first.keys() or any(not torch.equal(scalars[k], first[k]) for k in first):
            raise CheckpointError(
                f"the checkpoint's engines disagree on optimizer scalars ({first} vs {scalars}): it mixes "
                "engines at different steps and cannot be re-laid out"
            )
    return first


def rank_share(rt, weights: Weights) -> dict[str, Any]:
    """This rank's weights, buffers, moments and scalars under HF names (collective for ZeRO masters).

    Module weights come from ``state_dict`` so that tied weights appear under every name HF expects; masters and
    moments exist once per parameter (``named_parameters`` drops the tied alias).
    """
    engine = rt.engine
    moment_keys, scalars = _optimizer_layout(engine) if weights == "master" else ([], {})
    share: dict[str, Any] = {"params": {}, "buffers": {}, "moments": {k: {} for k in moment_keys}, "scalars": scalars}
    for part in _parts(rt):
        buffers = dict(persistent_buffers(part.module))
        if weights == "module":
            with gathered(engine, part.module):
                params = {n: t.detach().clone() for n, t in part.module.state_dict().items() if n not in buffers}
            params |= held_values(part.module)  # a frozen FP8 base (``fp8.frozen``, no state_dict entry): dequantized
            moments = {}
        else:
            named = dict(part.module.named_parameters())
            trained = {n: p for n, p in named.items() if p.requires_grad}  # frozen ones have no optimizer state
            moments = {k: {n: _full_state(engine, p, k) for n, p in trained.items()} for k in moment_keys}
            params = {n: _full_state(engine, p, None) for n, p in named.items()}
        # Only now: every rank of a data-parallel group takes part in _full_state's collectives.
        share["params"].update(part.pieces(params))
        share["buffers"].update(part.pieces({n: b.clone() for n, b in buffers.items()}))
        for k, values in moments.items():
            share["moments"][k].update(part.pieces(values))
    return share


@dataclass(frozen=True)
class _Part:
    """A module of a rank whose tensors are whole HF tensors (attention side; with tensor parallelism its attention
    modules' head shards), or rows of them (expert slice)."""

    module: nn.Module
    to_hf: Callable[[str], str]  # its tensor names -> HF in-memory names
    experts: range | None  # the rows it holds of HF's fused expert tensors (dim 0); None: whole tensors
    writer: bool  # this rank's copy of its whole tensors is the one read (one copy of every tensor in the job)
    shard_writer: bool = False  # this rank's copy of its head shards is the one read (one per TP rank)
    shards: dict[str, Shard] = field(default_factory=dict)  # by module name: the parameters that are head shards

    def pieces(self, tensors: dict[str, torch.Tensor]) -> Pieces:
        first = 0 if self.experts is None else self.experts.start
        pieces: Pieces = {}
        for name, tensor in tensors.items():
            shard = self.shards.get(name)
            if shard is not None and self.shard_writer:
                pieces[self.to_hf(name)] = (shard.rank, tensor, shard.dim)
            elif shard is None and self.writer:
                pieces[self.to_hf(name)] = (first, tensor)
        return pieces

    @property
    def reads(self) -> bool:
        return self.writer or (self.shard_writer and bool(self.shards))

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """What this part holds of HF's whole tensor ``full`` (module name ``name``)."""
        shard = self.shards.get(name)
        if shard is not None:
            return full.chunk(shard.size, shard.dim)[shard.rank]
        return full if self.experts is None else full[self.experts.start : self.experts.stop]


def _parts(rt) -> list[_Part]:
    """A disaggregated rank holds one stage. A co-located rank holds its pipeline stage's attention side (a replica
    on every rank of the stage: lane 0's is read; with TP, head shards: lanes 0..t-1 hold one of each TP rank) and
    an expert slice (replicated over its edp group: the first replica's is read)."""
    role = rt.role
    if isinstance(rt.layout, Layout) and not role.is_attention:
        return [_expert_part(rt.module, writer=role.edp_rank == 0)]
    attention_module = rt.module if isinstance(rt.layout, Layout) else rt.module.attention
    shards = {n: shard for n, p in attention_module.named_parameters() if (shard := shard_of(p)) is not None}
    t = rt.layout.tensor_parallel
    attention = _Part(attention_module, attention_name_to_hf, None, role.index == 0, role.index < t, shards)
    if isinstance(rt.layout, Layout) or rt.module.experts is None:  # co-located: a pipeline stage of dense layers
        return [attention]
    return [attention, _expert_part(rt.module.experts.stage, writer=role.edp_rank == 0)]


def holds_read_copy(rt) -> bool:
    """Whether this rank's copy of some tensor is the one read (its share is not empty)."""
    return any(part.reads for part in _parts(rt))


def _expert_part(stage: ExpertStage, *, writer: bool) -> _Part:
    experts = range(stage.first_expert, stage.first_expert + stage.num_local)
    return _Part(stage, expert_name_to_hf, experts, writer)


def read_share(rt, weights: Weights, *, extras: bool) -> dict[str, Any]:
    """This rank's input to ``gather_state``: its ``rank_share`` with, where ``extras``, its ``engine_extras``; empty
    where every tensor it holds is read from another rank's copy. Collective like ``rank_share``: every rank calls it.
    """
    share = rank_share(rt, weights)
    if not holds_read_copy(rt):
        return {}
    if extras:
        share["extras"] = engine_extras(rt.engine)
    return share


def gather_state(shares: list[dict[str, Any]], client_state: dict[str, Any]) -> TrainState:
    """The job's state from every rank's ``read_share`` (one of them with ``extras``)."""
    shares = [share for share in shares if share]
    extras = next(share["extras"] for share in shares if "extras" in share)
    moments = {key: join_pieces([s["moments"].get(key, {}) for s in shares]) for key in shares[0]["moments"]}
    return TrainState(
        params=join_pieces([s["params"] for s in shares]),
        buffers=join_pieces([s["buffers"] for s in shares]),
        moments=moments,
        scalars=one_scalar_set([s["scalars"] for s in shares]),
        client_state=dict(client_state),
        **extras,
    )


def engine_extras(engine) -> dict[str, Any]:
    """What every engine of the job shares: param-group values, scheduler, counters."""
    hyper = {k: v for k, v in engine.optimizer.param_groups[0].items() if k != "params"}
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    counters = {"global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps}
    return {"hyper": hyper, "scheduler": scheduler, "counters": counters}


# ----- where the optimizer keeps a parameter's state: ZeRO 1/2 flat partitions, or per parameter (ZeRO 0) -----


def _is_zero(engine) -> bool:
    return engine.zero_optimization_stage() > 0


def _is_zero3(engine) -> bool:
    return engine.zero_optimization_stage() == 3


def gathered(engine, module: nn.Module) -> AbstractContextManager:
    """Inside it, ``module``'s parameters are whole (ZeRO-3 gathers them over their replicas: every replica must
    enter it together); a no-op below stage 3."""
    if not _is_zero3(engine):
        return nullcontext()
    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)


def _inner_state(engine) -> dict:
    """The torch optimizer's ``state``: keyed by flat fp32 partition (ZeRO) or by parameter (ZeRO 0)."""
    return engine.optimizer.optimizer.state if _is_zero(engine) else engine.optimizer.state


def _state_owners(engine) -> list[torch.Tensor]:
    if _is_zero3(engine):
        return list(engine.optimizer.fp32_partitioned_groups_flat)
    if _is_zero(engine):
        return list(engine.optimizer.single_partition_of_fp32_groups)
    return [p for group in engine.optimizer.param_groups for p in group["params"]]


def _optimizer_layout(engine) -> tuple[list[str], dict[str, torch.Tensor]]:
    """This rank's per-element state keys and its scalars (none before the first step).

    Every owner of state (flat partition or parameter) must hold the same scalars, since one set is carried.
    """
    state = _inner_state(engine)
    entries = [state[owner] for owner in _state_owners(engine) if owner in state]
    if not entries:
        return [], {}
    keys = sorted(k for k, v in entries[0].items() if torch.is_tensor(v) and v.dim() > 0)
    scalars = {k: v.clone() for k, v in entries[0].items() if k not in keys}
    for entry in entries[1:]:
        if any(not torch.equal(torch.as_tensor(entry[k]), torch.as_tensor(v)) for k, v in scalars.items()):
            raise CheckpointError(
                "parameters of one engine are at different optimizer steps (some never received a gradient); "
                "a re-layout carries one step count for all of them"
            )
    return keys, scalars


def _full_state(engine, param: nn.Parameter, key: str | None) -> torch.Tensor:
    """The fp32 master (``key`` None) or optimizer state ``key`` of the whole parameter.

    ZeRO: each rank of the parameter's data-parallel group holds a fragment; one all-reduce (every other rank
    contributes zeros) assembles it, so every rank of the group must call this for the same parameters in order.
    """
    if _is_zero3(engine):
        return _full_state_z3(engine, param, key)
    if not param.requires_grad:  # frozen: no master, no state; the module weight never changes
        return param.detach().float().clone()
    if not _is_zero(engine):
        return (param.detach() if key is None else engine.optimizer.state[param][key]).float().clone()
    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    for src, dst in _fragments(engine, param, key):
        full.narrow(0, dst.start, dst.numel).copy_(src)
    dist.all_reduce(full, group=param._dp_group)  # type: ignore[attr-defined]  # DeepSpeed sets it
    return full.view(param.shape)


def _fragments(engine, param: nn.Parameter, key: str | None) -> Iterator[tuple[torch.Tensor, Any]]:
    """This rank's ZeRO fragment of ``param`` (view into the flat partition) and its address in the param."""
    mapping = param._hp_mapping  # type: ignore[attr-defined]  # DeepSpeed's ZeRO-1/2 fragment address
    if mapping is None:  # the parameter lies wholly in other ranks' partitions
        return
    flat = engine.optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
    source = flat if key is None else engine.optimizer.optimizer.state[flat][key]
    hp = mapping.hp_fragment_address
    yield source.narrow(0, hp.start, hp.numel), mapping.lp_fragment_address


def _full_state_z3(engine, param: nn.Parameter, key: str | None) -> torch.Tensor:
    """ZeRO-3's ``_full_state``: an all-gather over the parameter's replicas (collective like it)."""
    if not param.requires_grad:
        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().float().clone()
    return engine.optimizer.get_full_hp_param(param, key).float().clone()


def _set_partition_z3(engine, param: nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """Write this rank's rows of ``value`` (the whole tensor) into the parameter's ZeRO-3 master (and its bit16
    shard) or moment ``key``; the padding after the last element stays as it is."""
    optimizer = engine.optimizer
    group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
    flat = optimizer.fp32_partitioned_groups_flat[group]
    dst = (flat if key is None else optimizer.optimizer.state[flat][key]).narrow(0, offset, numel)
    start = numel * dist.get_rank(param.ds_process_group)  # type: ignore[attr-defined]  # ZeRO-3's
    src = value.reshape(-1)[start : start + numel]
    dst[: src.numel()].copy_(src)
    if key is None:
        param.ds_tensor.view(-1)[: src.numel()].copy_(src)  # type: ignore[attr-defined]  # ZeRO-3's shard


# ----- writing a state into a freshly built rank -----


def set_rank_state(rt, state: TrainState) -> None:
    engine = rt.engine
    if state.moments:
        _create_optimizer_state(engine, list(state.moments), state.scalars)
    for part in _parts(rt):
        for name, param in part.module.named_parameters():
            hf_name = part.to_hf(name)
            _set_full(engine, param, part.local(name, state.params[hf_name]), None)
            for key, values in state.moments.items():
                if param.requires_grad:
                    _set_full(engine, param, part.local(name, values[hf_name]), key)
        with torch.no_grad():
            for name, buf in persistent_buffers(part.module):
                buf.copy_(part.local(name, state.buffers[part.to_hf(name)]))
    for group in engine.optimizer.param_groups:
        group.update(state.hyper)
    if engine.lr_scheduler is not None and state.scheduler is not None:
        engine.lr_scheduler.load_state_dict(state.scheduler)
    engine.global_steps = state.counters["global_steps"]
    engine.skipped_steps = state.counters["skipped_steps"]
    engine.global_samples = engine.global_steps * engine.train_batch_size()


def _create_optimizer_state(engine, keys: list[str], scalars: dict[str, torch.Tensor]) -> None:
    """Give every state owner the optimizer's entries (torch optimizers create them lazily in ``step``)."""
    state = _inner_state(engine)
    for owner in _state_owners(engine):
        entry = {k: torch.zeros_like(owner, dtype=torch.float32) for k in keys}
        entry.update({k: v.clone() for k, v in scalars.items()})
        state[owner] = entry


def _set_full(engine, param: nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """Write the whole parameter's master (and module weight) or state ``key`` from the full tensor ``value``."""
    with torch.no_grad():
        if _is_zero3(engine) and param.requires_grad:
            _set_partition_z3(engine, param, value, key)
            return
        if _is_zero3(engine):  # frozen: only the module weight, whole on every replica while gathered
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(value)
            return
        if key is None:
            param.data.copy_(value)  # the module weight; rounds to bf16 exactly as DeepSpeed's step does
        if not param.requires_grad or not _is_zero(engine):
            if key is not None:
                engine.optimizer.state[param][key].copy_(value)
            return
        flat_value = value.reshape(-1)
        for dst, src in _fragments(engine, param, key):
            dst.copy_(flat_value.narrow(0, src.start, src.numel))


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers that belong to the checkpoint (DeepSeek-V3's expert bias; not the rotary tables)."""
    saved = module.state_dict()
    for name, buf in module.named_buffers():
        if name in saved:
            yield name, buf


def module_pieces(rt) -> dict[str, Pieces]:
    """This rank's module weights and buffers under HF names, for an HF export (empty where another rank's copy of
    a tensor is the one read). ``join_module_pieces`` of every rank's pieces is the whole model."""
    share = rank_share(rt, "module")
    return {"params": share["params"], "buffers": share["buffers"]}


def join_module_pieces(shares: list[dict[str, Pieces]]) -> dict[str, torch.Tensor]:
    return {**join_pieces([s["params"] for s in shares]), **join_pieces([s["buffers"] for s in shares])}
