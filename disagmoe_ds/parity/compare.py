"""What the ranks trained, under HF names, against the reference: the gradients the optimizer applied (read out of
ZeRO's partitions), the parameters after every step, the losses and the global gradient norms."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import torch

from disagmoe_ds.models.naming import attention_name_to_hf, expert_name_to_hf
from disagmoe_ds.models.tensor_parallel import shard_of
from disagmoe_ds.parity.reference import (
    TOLERANCE,
    VerifyArgs,
)


class RankRecord(TypedDict):
    """What one rank of a verify run reports for ``compare``: its losses and global gradient norms (the same on
    every rank), and its share of the parameters and of each step's gradients under HF names (``hf_named``)."""

    rank: int
    losses: list[float]
    grad_norms: list[float | None]
    params: dict[str, tuple]
    grads: list[dict[str, tuple]]


def capture_grads(runtime, named: Callable[[Any, dict[str, torch.Tensor]], dict[str, tuple]] | None = None):
    """Record, at every step, the reduced and clipped gradients the optimizer applies, by HF name (``named``: this
    rank's share of them under HF names; default ``hf_named``).

    ZeRO steps its torch optimizer once per parameter group (a co-located rank's dense and MoE groups, an attention
    rank's replicated parameters and head shards), each time with only that group's fp32 gradient in place, so each
    call records the parameters of its own group.
    """
    to_hf = named or hf_named
    optimizer = runtime.engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps a torch optimizer
    captured: list[dict[str, tuple]] = []

    def hook(*_):
        group = _zero_group_index(optimizer, inner)
        if group in (None, 0):
            captured.append({})
        mine = None if group is None else {id(p) for p in optimizer.bit16_groups[group]}
        params = {n: p for n, p in runtime.module.named_parameters() if mine is None or id(p) in mine}
        grads = {n: full_grad(optimizer, p) for n, p in params.items()}
        captured[-1].update(to_hf(runtime, {n: g for n, g in grads.items() if g is not None}))

    inner.register_step_pre_hook(hook)
    return captured


def _zero_group_index(optimizer, inner) -> int | None:
    """The parameter group ZeRO is stepping (it narrows ``inner.param_groups`` to it); None without ZeRO 1/2."""
    partitions = getattr(optimizer, "single_partition_of_fp32_groups", None)
    if partitions is None:
        return None
    stepped = inner.param_groups[0]["params"][0]
    return next(i for i, partition in enumerate(partitions) if partition is stepped)


def full_grad(optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """The reduced, clipped gradient the optimizer applies to ``param`` (assembled from ZeRO partitions)."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3: the param's rows of its fp32 partition's grad
        if len(optimizer.fp32_partitioned_groups_flat) > 1:
            raise RuntimeError("verify reads ZeRO-3 gradients of one optimizer sub-group (raise sub_group_size)")
        group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
        grad = optimizer.fp32_partitioned_groups_flat[group].grad.narrow(0, offset, numel)
        return optimizer._fp32_state_allgather(param, grad)
    mapping: Any = getattr(param, "_hp_mapping", "plain")  # DeepSpeed's ZeRO-1/2 fragment address
    if mapping == "plain":
        return param.grad
    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    if mapping is not None:  # this rank's ZeRO partition holds a fragment of the parameter
        flat = optimizer.single_partition_of_fp32_groups[mapping.param_group_index].grad
        hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
        full.narrow(0, lp.start, lp.numel).copy_(flat.narrow(0, hp.start, hp.numel))
    torch.distributed.all_reduce(full, group=param._dp_group)  # type: ignore[attr-defined]  # DeepSpeed sets it
    return full.view_as(param)


def hf_named(runtime, tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """This rank's tensors under HF names, each ``(first, tensor)``: expert slices carry their first expert id (to
    reassemble them), attention-head shards (tensor parallel) are ``(rank, tensor, dim)``, and the TP ranks but the
    first leave out what they replicate."""
    if not runtime.role.is_attention:
        return {expert_name_to_hf(n): (runtime.module.first_expert, t.float().clone()) for n, t in tensors.items()}
    shards = {n: shard_of(p) for n, p in runtime.module.named_parameters()}
    first_tp = runtime.role.index % getattr(runtime.layout, "tensor_parallel", 1) == 0  # co-located: no TP
    named: dict[str, tuple] = {}
    for n, t in tensors.items():
        shard = shards.get(n)
        if shard is not None:
            named[attention_name_to_hf(n)] = (shard.rank, t.float().clone(), shard.dim)
        elif first_tp:
            named[attention_name_to_hf(n)] = (0, t.float().clone())
    return named


def assemble(pieces_by_rank: list[dict[str, tuple]]) -> dict[str, torch.Tensor]:
    """Join the ranks' tensors into HF's: expert slices concatenated in expert order, head shards in rank order."""
    merged: dict[str, list[tuple]] = {}
    for pieces in pieces_by_rank:
        for name, piece in pieces.items():
            merged.setdefault(name, []).append(piece)
    return {
        n: torch.cat([piece[1] for piece in sorted(p, key=lambda x: x[0])], dim=p[0][2] if len(p[0]) == 3 else 0)
        for n, p in merged.items()
    }


def _max_diff(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    missing = sorted(set(ref) - set(ours))
    if missing:
        raise RuntimeError(f"the disaggregated run has no values for {missing[:3]}...")
    return max((ours[n] - ref[n]).abs().max().item() for n in ref)


def compare(ranks: Sequence[RankRecord], ref: dict[str, Any], args: VerifyArgs) -> dict[str, Any]:
    param_diff = _max_diff(assemble([r["params"] for r in ranks]), ref["params"])
    grad_diff = max(
        _max_diff(assemble([r["grads"][step] for r in ranks if r["grads"]]), ref["grads"][step])
        for step in range(args.steps)
    )
    loss_diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref["losses"]))
    norms = ranks[0]["grad_norms"]
    known = [n for n in norms if n is not None]  # all of them, or the norms are not compared
    norm_diff = max(abs(a - b) for a, b in zip(known, ref["grad_norms"])) if len(known) == len(norms) else None
    tol = TOLERANCE[args.dtype]
    ok = (
        loss_diff <= tol
        and param_diff <= tol
        and grad_diff <= tol
        and (norm_diff is None or norm_diff <= tol * max(1.0, *known))
    )
    return {
        "model": args.model,
        "layout": args.cfg.to_dict(),
        "zero": args.zero,
        "dtype": args.dtype,
        "steps": args.steps,
        "losses": ranks[0]["losses"],
        "reference_losses": ref["losses"],
        "grad_norms": norms,
        "reference_grad_norms": ref["grad_norms"],
        "max_abs_diff": {"loss": loss_diff, "grad_norm": norm_diff, "grads": grad_diff, "params": param_diff},
        "tolerance": tol,
        "pass": ok,
    }
