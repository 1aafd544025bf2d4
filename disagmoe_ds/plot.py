"""The loss curve of a run as an SVG any browser shows, with nothing to install.

    python -m disagmoe_ds.plot runs/q30/metrics.jsonl            # writes runs/q30/metrics.svg
    python -m disagmoe_ds.plot metrics.jsonl -o loss.svg

``run_pretrain.py --metrics-file F`` writes ``F`` with the suffix ``.svg`` at the end of the run. The training loss
is a line over the steps; the evaluation loss (``eval_loss`` records, where the run evaluated) is drawn as points
joined by a dashed line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from html import escape
from pathlib import Path

WIDTH, HEIGHT = 720, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 24, 36, 48  # margins around the plot area
SERIES = (("loss", "training loss", "#1f77b4", ""), ("eval_loss", "eval loss", "#d62728", "6 4"))


def read_series(metrics: Path) -> dict[str, list[tuple[int, float]]]:
    """``{field: [(step, value), ...]}`` of the fields in ``SERIES`` (a half-written last line is skipped)."""
    series: dict[str, list[tuple[int, float]]] = {field: [] for field, *_ in SERIES}
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        for field in series:
            value = record.get(field)
            if isinstance(value, (int, float)) and math.isfinite(value):
                series[field].append((int(record["step"]), float(value)))
    return series


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    raw = (high - low) / count or 1.0
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    return [step * k for k in range(math.ceil(low / step), math.floor(high / step) + 1)]


def loss_svg(series: dict[str, list[tuple[int, float]]], title: str) -> str:
    """The SVG document of ``series`` (steps on x, loss on y)."""
    points = [p for values in series.values() for p in values]
    if not points:
        raise ValueError("no loss records to plot")
    x0, x1 = min(s for s, _ in points), max(s for s, _ in points)
    y0, y1 = min(v for _, v in points), max(v for _, v in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def x(step: float) -> float:
        return LEFT + (step - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT)

    def y(value: float) -> float:
        return HEIGHT - BOTTOM - (value - y0) / (y1 - y0) * (HEIGHT - TOP - BOTTOM)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
        f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 8}" text-anchor="middle">step</text>',
    ]
    for tick in _ticks(y0, y1):
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>')
    for tick in _ticks(x0, x1):
        parts.append(f'<text x="{x(tick):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{tick:g}</text>')
    frame = f"M{LEFT},{TOP} V{HEIGHT - BOTTOM} H{WIDTH - RIGHT}"
    parts.append(f'<path d="{frame}" fill="none" stroke="black"/>')
    for row, (field, label, color, dash) in enumerate(SERIES):
        values = series.get(field, [])
        if not values:
            continue
        path = " ".join(f"{'M' if i == 0 else 'L'}{x(s):.1f},{y(v):.1f}" for i, (s, v) in enumerate(values))
        parts.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="1.5" stroke-dasharray="{dash}"/>')
        if dash:  # sparse evaluations: mark each one
            parts += [f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>' for s, v in values]
        legend_y = TOP + 8 + 16 * row
        parts.append(f'<line x1="{WIDTH - 150}" x2="{WIDTH - 126}" y1="{legend_y}" y2="{legend_y}" stroke="{color}" '
                     f'stroke-width="2" stroke-dasharray="{dash}"/>')  # fmt: skip
        parts.append(f'<text x="{WIDTH - 120}" y="{legend_y + 4}">{label} (last {values[-1][1]:.3f})</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_loss_plot(metrics: Path, out: Path | None = None) -> Path:
    """Draw ``metrics`` (a --metrics-file) into ``out`` (default: beside it, suffix .svg); returns the path."""
    out = metrics.with_suffix(".svg") if out is None else out
    out.write_text(loss_svg(read_series(metrics), title=f"loss of {metrics.name}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagmoe_ds.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, help="a run's --metrics-file (JSON lines)")
    parser.add_argument("-o", "--out", type=Path, help="the SVG to write (default: the metrics file's name, .svg)")
    args = parser.parse_args(argv)
    try:
        print(write_loss_plot(args.metrics, args.out))
    except (OSError, ValueError) as err:
        print(f"python -m disagmoe_ds.plot: error: {args.metrics}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
