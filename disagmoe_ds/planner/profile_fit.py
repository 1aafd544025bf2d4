"""A ``disagmoe-plan profile`` JSON: its format, reading it, fitting its time models and predicting with them
(pure Python; ``profile.py`` measures and writes one).

Format "disagmoe-profile/1": device, versions, model; ``points``, one per measured sequence length, each with
per-part {fwd_s, bwd_s, linear_flops, core_flops, tokens}; ``fit``, the per-call time models the planner uses
(``cluster.PartModel``: t = per_flop * linear + per_core_flop * core + per_call, fitted by least squares to the
points: all three terms for attention from 3 points on, flops + per-call for the experts from 2 points on, a
single rate from one point); ``nvlink_bytes_per_s`` when two GPUs exist (a device-to-device copy);
``nic_bytes_per_s`` is null unless filled in from a multi-node measurement (e.g. nccl-tests); both replace a
preset cluster's nominal links, never a cluster JSON's (``rates_from_profile``). A single point
cannot separate per-call overhead from the s^2 core, and ``profile_warnings`` says when the planner extrapolates.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.planner.cluster import Cluster, Efficiency, PartModel, Rates
from disagmoe_ds.planner.inputs import read_json
from disagmoe_ds.planner.model import ModelSpec

FORMAT = "disagmoe-profile/1"

_PARTS = ("attention_fwd", "attention_bwd", "experts_fwd", "experts_bwd")


def load_profile(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--profile {path}: no such file; write one with `disagmoe-plan profile`")
    data = read_json(path, "--profile")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"--profile {path}: format is not {FORMAT!r}; write one with `disagmoe-plan profile`")
    for key in _PARTS:
        model = (data.get("fit") or {}).get(key)
        if not isinstance(model, dict) or not all(
            isinstance(model.get(k), (int, float)) for k in ("per_flop", "per_core_flop", "per_call")
        ):
            raise ConfigError(f"--profile {path}: fit.{key} must hold per_flop, per_core_flop and per_call")
    return data


def part_models(profile: dict[str, Any]) -> dict[str, PartModel]:
    return {key: PartModel(**{k: float(v) for k, v in profile["fit"][key].items()}) for key in _PARTS}


def rates_from_profile(profile: dict[str, Any], cluster: Cluster, eff: Efficiency, *, measured_links: bool) -> Rates:
    """Measured time models replace peak x efficiency. The profile's measured link bandwidths
    (``nvlink_bytes_per_s``, ``nic_bytes_per_s``) replace the cluster's only with ``measured_links``: for a preset,
    whose links are nominal numbers. A cluster JSON describes the user's links (a socket transport, another
    machine than the profiled one), so its numbers win.
    """
    base = Rates.from_cluster(cluster, eff)
    seqs = sorted(pt["seq_len"] for pt in profile["points"])
    keys = {"nvlink_bw": "nvlink_bytes_per_s", "nic_bw": "nic_bytes_per_s"}
    links = {f: float(profile[k]) for f, k in keys.items() if measured_links and profile.get(k)}
    where = " and ".join(f"{f} from the profile" for f in links) or "links from the cluster"
    fitted = part_models(profile)
    return replace(
        base,
        attention_fwd=fitted["attention_fwd"],
        attention_bwd=fitted["attention_bwd"],
        experts_fwd=fitted["experts_fwd"],
        experts_bwd=fitted["experts_bwd"],
        nvlink_bw=links.get("nvlink_bw", base.nvlink_bw),
        nic_bw=links.get("nic_bw", base.nic_bw),
        source=f"profile of {profile.get('model')} at seq {seqs} on {profile.get('device')}; {where}",
    )


def profile_warnings(profile: dict[str, Any], spec: ModelSpec, seq_len: int) -> list[str]:
    """Where a profile is used outside the conditions it was measured in."""
    out = []
    if profile.get("model_type") != spec.model_type:
        out.append(f"profile measured {profile.get('model_type')}, planning {spec.model_type}")
    seqs = [pt["seq_len"] for pt in profile["points"]]
    if not min(seqs) <= seq_len <= max(seqs):
        out.append(f"profile measured at seq {sorted(seqs)}, planning seq {seq_len}: extrapolating its time model")
    return out


def _solve(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares by the normal equations (Gauss-Jordan); None when singular."""
    n = len(rows[0])
    a = [
        [sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))] for i in range(n)
    ]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-30:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit_part(points: list[tuple[float, float, float]]) -> PartModel:
    """Fit t = per_flop * linear + per_core_flop * core + per_call to (linear, core, seconds) points.

    Uses as many terms as the points determine (3: all; 2: one per-FLOP rate + per-call; 1: one rate) and
    drops terms whose fitted value is negative. FLOPs are scaled to TFLOP so the equations are well conditioned.
    """
    has_core = any(core > 0 for _, core, _ in points)
    layouts = [("lin", "core", "call"), ("all", "call"), ("all",)] if has_core else [("all", "call"), ("all",)]
    for terms in layouts:
        if len(terms) > len(points):
            continue
        rows = [
            [{"lin": lin, "core": core, "all": lin + core, "call": 1e12}[t] / 1e12 for t in terms]
            for lin, core, _ in points
        ]
        coef = _solve(rows, [t for _, _, t in points])
        if coef is None or min(coef) < 0:
            continue
        c = dict(zip(terms, (x / 1e12 for x in coef)))
        per_flop = c.get("lin", c.get("all", 0.0))
        return PartModel(per_flop, c.get("core", per_flop), c.get("call", 0.0) * 1e12)
    raise ConfigError("the profile's measurements do not determine a positive time model; repeat the measurement")


def fit_profile(points: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The ``fit`` section of a profile from its ``points``."""
    out = {}
    for part in ("attention", "experts"):
        for phase in ("fwd", "bwd"):
            data = [(pt[part]["linear_flops"], pt[part]["core_flops"], pt[part][f"{phase}_s"]) for pt in points]
            model = fit_part(data)
            out[f"{part}_{phase}"] = {
                "per_flop": model.per_flop,
                "per_core_flop": model.per_core_flop,
                "per_call": model.per_call,
            }
    return out


def part_flops(spec: ModelSpec, *, seq_len: int, tokens: int) -> dict[str, tuple[float, float]]:
    """(linear, core) forward FLOPs of the measured attention part and expert part of the first MoE layer."""
    layer = spec.moe_layers.index(True)
    core = tokens * spec.attention_core_flops(seq_len, layer)
    return {
        "attention": (tokens * spec.attention_side_flops(seq_len, layer) - core, core),
        "experts": (tokens * spec.routed_flops_per_token(), 0.0),
    }


def predicted_times(spec: ModelSpec, profile: dict[str, Any], *, seq_len: int, tokens: int) -> dict[str, float]:
    """Per-part forward and backward seconds of one call for ``tokens`` tokens at ``seq_len`` (profile's fit)."""
    models, flops = part_models(profile), part_flops(spec, seq_len=seq_len, tokens=tokens)
    return {
        f"{part}_{phase}_s": models[f"{part}_{phase}"].seconds(*flops[part])
        for part in ("attention", "experts")
        for phase in ("fwd", "bwd")
    }
