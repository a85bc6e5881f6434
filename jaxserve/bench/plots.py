"""Benchmark plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _front(ax, xs: Sequence[float], ys: Sequence[float], on: Sequence[bool]) -> None:
    pts = sorted((x, y) for x, y, f in zip(xs, ys, on) if f)
    if pts:
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="tab:red", lw=1,
                label="Pareto front")


def plot_bucket_tradeoffs(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str = "",
                          modeled: bool = False) -> None:
    """Two panels, one point per policy, Pareto points in red.

    Left: padded-token fraction against programs compiled. Right: output
    tokens/s against cold warm-up seconds. `rows` are `bench buckets` policy
    rows (keys: name, programs, padding_fraction, output_tokens_per_s,
    warmup_cold_s, pareto_padding, pareto_throughput).
    """
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    tag = " (modeled)" if modeled else ""
    for ax, xk, yk, fk, xl, yl in (
            (a1, "programs", "padding_fraction", "pareto_padding", "programs compiled",
             "padded-token fraction"),
            (a2, "warmup_cold_s", "output_tokens_per_s", "pareto_throughput",
             f"cold warm-up seconds{tag}", f"output tokens/s{tag}")):
        xs = [r[xk] for r in rows]
        ys = [r[yk] for r in rows]
        on = [r[fk] for r in rows]
        ax.scatter(xs, ys, c=["tab:red" if f else "tab:blue" for f in on], zorder=3)
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(r["name"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        _front(ax, xs, ys, on)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"bucket policies on {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(points: Sequence[tuple[int, float]], path: str | Path, *, title: str = "") -> None:
    """Output tokens/s against max_num_seqs (log2 x axis)."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    ax.plot(xs, ys, "o-")
    for x, y in points:
        ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_num_seqs")
    ax.set_ylabel("useful output tokens/s")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
