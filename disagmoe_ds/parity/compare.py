"""What the ranks trained, under HF names, against the reference: the gradients the optimizer applied (read out of
ZeRO's partitions), the parameters after every step, the losses and the global gradient norms."""

from __future__ import annotations

from typing import Any

import torch

from disagmoe_ds.models.naming import attention_name_to_hf, expert_name_to_hf
from disagmoe_ds.parity.reference import (
    TOLERANCE,
    VerifyArgs,
)


def capture_grads(runtime) -> list[dict[str, tuple[int, torch.Tensor]]]:
    """Record, at every step, the gradients the optimizer is about to apply (reduced and clipped), by HF name."""
    optimizer = runtime.engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps a torch optimizer
    captured: list[dict[str, tuple[int, torch.Tensor]]] = []

    def hook(*_):
        named = {n: full_grad(optimizer, p) for n, p in runtime.module.named_parameters()}
        captured.append(hf_named(runtime, {n: g for n, g in named.items() if g is not None}))

    inner.register_step_pre_hook(hook)
    return captured


def full_grad(optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """The reduced, clipped gradient the optimizer applies to ``param`` (assembled from ZeRO partitions)."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3: the param's rows of its fp32 partition's grad
        if len(optimizer.fp32_partitioned_groups_flat) > 1:
            raise RuntimeError("verify reads ZeRO-3 gradients of one optimizer sub-group (raise sub_group_size)")
        group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
        grad = optimizer.fp32_partitioned_groups_flat[group].grad.narrow(0, offset, numel)
        return optimizer._fp32_state_allgather(param, grad)
    mapping = getattr(param, "_hp_mapping", "plain")
    if mapping == "plain":
        return param.grad
    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    if mapping is not None:  # this rank's ZeRO partition holds a fragment of the parameter
        flat = optimizer.single_partition_of_fp32_groups[mapping.param_group_index].grad
        hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
        full.narrow(0, lp.start, lp.numel).copy_(flat.narrow(0, hp.start, hp.numel))
    torch.distributed.all_reduce(full, group=param._dp_group)
    return full.view_as(param)


def hf_named(runtime, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, torch.Tensor]]:
    """This rank's tensors under HF names; expert slices carry their first expert id (to reassemble them)."""
    if runtime.role.is_attention:
        return {attention_name_to_hf(n): (0, t.float().clone()) for n, t in tensors.items()}
    return {expert_name_to_hf(n): (runtime.module.first_expert, t.float().clone()) for n, t in tensors.items()}


def assemble(pieces_by_rank: list[dict[str, tuple[int, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Join the ranks' tensors into HF's: expert slices concatenated in expert order."""
    merged: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for pieces in pieces_by_rank:
        for name, (first, value) in pieces.items():
            merged.setdefault(name, []).append((first, value))
    return {n: torch.cat([v for _, v in sorted(p, key=lambda x: x[0])]) for n, p in merged.items()}


def _max_diff(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    missing = sorted(set(ref) - set(ours))
    if missing:
        raise RuntimeError(f"the disaggregated run has no values for {missing[:3]}...")
    return max((ours[n] - ref[n]).abs().max().item() for n in ref)


def compare(ranks: list[dict[str, Any]], ref: dict[str, Any], args: VerifyArgs) -> dict[str, Any]:
    param_diff = _max_diff(assemble([r["params"] for r in ranks]), ref["params"])
    grad_diff = max(
        _max_diff(assemble([r["grads"][step] for r in ranks if r["grads"]]), ref["grads"][step])
        for step in range(args.steps)
    )
    loss_diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref["losses"]))
    norms = ranks[0]["grad_norms"]
    norm_diff = max(abs(a - b) for a, b in zip(norms, ref["grad_norms"])) if all(n is not None for n in norms) else None
    tol = TOLERANCE[args.dtype]
    ok = (
        loss_diff <= tol
        and param_diff <= tol
        and grad_diff <= tol
        and (norm_diff is None or norm_diff <= tol * max(1.0, *norms))
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
