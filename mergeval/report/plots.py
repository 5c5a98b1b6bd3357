"""The report's PNG plots, drawn with matplotlib's object API on the Agg canvas (no display, no global state)."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure

from mergeval.core.outcome import fixed
from mergeval.report.data import Pareto, Series, short

DPI = 120


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, format="png", bbox_inches="tight")  # a Figure without a canvas renders with Agg
    return path


def plot_pareto(p: Pareto, path: Path) -> Path:
    """Merged points, their Pareto front, the base and experts, and the diagonal between the two experts.

    Every run is a number beside its point and a line of the key to the right (the front's runs marked),
    so labels never overlap however many runs there are; runs at the same point share one label."""
    fig = Figure(figsize=(10.5, 5.8))
    ax = fig.add_axes((0.08, 0.16, 0.52, 0.76))
    for role, (x, y) in p.references.items():  # below the merged points, hollow, so none hides a run
        marker, color = ("s", "gray") if role == "base" else ("*", "tab:orange")
        ax.scatter([x], [y], marker=marker, s=170 if marker == "*" else 80, facecolors="none", edgecolors=color,
                   linewidths=1.5, zorder=2)
        ax.annotate(role, (x, y), textcoords="offset points", xytext=(7, -12), fontsize=8, color=color)
    if p.diagonal:
        (x1, y1), (x2, y2) = (p.references[r] for r in p.diagonal)
        ax.plot([x1, x2], [y1, y2], linestyle="--", color="tab:orange", label="diagonal between the experts", zorder=1)
    front = set(p.front)
    xs, ys = zip(*p.points)
    ax.scatter(xs, ys, color="tab:blue", s=22, zorder=3, label="merged runs")
    ordered = sorted(p.front, key=lambda i: p.points[i][0])
    ax.plot(*zip(*(p.points[i] for i in ordered)), color="tab:blue", linewidth=1.5, marker="o", markersize=11,
            markerfacecolor="none", label="Pareto front", zorder=3)
    at: dict[tuple[float, float], list[int]] = {}
    for i, (x, y) in enumerate(p.points):
        at.setdefault((round(x, 6), round(y, 6)), []).append(i)
    for (x, y), runs in at.items():
        text = ",".join(str(i + 1) for i in runs)
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7,
                    fontweight="bold" if any(i in front for i in runs) else "normal")
    key = [f"{'*' if i in front else ' '} {i + 1:>2}  {label}" for i, label in enumerate(p.labels)]
    fig.text(0.63, 0.92, "runs (* on the Pareto front)\n" + "\n".join(key), va="top", ha="left", fontsize=7,
             family="monospace")
    area = f"{p.area:+.4f}" if p.area is not None else p.area_note.split(":")[0]
    ax.set_title(f"{short(p.task_x)} vs {short(p.task_y)}: synergy area {area}", fontsize=10)
    ax.set_xlabel(f"{short(p.task_x)} ({p.metrics[0]})")
    ax.set_ylabel(f"{short(p.task_y)} ({p.metrics[1]})")
    ax.grid(alpha=0.3)
    ax.margins(x=0.08, y=0.08)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    return _save(fig, path)


def plot_score_vs_param(series: Series, param: str, tasks: list[str], base: dict[str, float], path: Path,
                        metrics: dict[str, str] | None = None) -> Path:
    """Each task's merged score +- stderr versus ``param``: one panel per task (titled with its metric), one line
    per method, the base dotted."""
    fig = Figure(figsize=(4.2 * len(tasks), 3.8))
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks):
        for label, per_task in series.items():
            xs, accs, errs = zip(*per_task[task]) if per_task[task] else ((), (), ())
            ax.errorbar(xs, accs, yerr=errs, marker="o", capsize=3, label=label)
        if task in base:
            ax.axhline(base[task], color="gray", linestyle=":", label="base")
        ax.set_title(f"{short(task)} ({(metrics or {}).get(task, 'acc,none')})", fontsize=10)
        ax.set_xlabel(param)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("merged score ± stderr")
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    return _save(fig, path)


def plot_normalized(tasks: list[str], table: dict[str, dict[str, float | None]], path: Path) -> Path:
    """Grouped bars: per expert task, each method's normalized score (1 = the expert's gain kept, 0 = base)."""
    fig = Figure(figsize=(max(4.5, 0.5 * len(tasks) * max(2, len(table))), 4.2))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(table))
    for k, (label, values) in enumerate(table.items()):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(tasks))]
        heights = [math.nan if v is None else v for v in (values[t] for t in tasks)]
        bars = ax.bar(xs, heights, width=width, label=label)
        color = bars.patches[0].get_facecolor() if bars.patches else None
        for x, h in zip(xs, heights):
            if math.isnan(h):
                ax.annotate("undefined", (x, 0), ha="center", va="bottom", rotation=90, fontsize=7)
            elif abs(h) < 0.02:  # a bar too short to see: a mark at zero in its colour, and its value
                ax.plot([x - width * 0.45, x + width * 0.45], [h, h], color=color, linewidth=3, solid_capstyle="butt")
                ax.annotate(fixed(h), (x, h), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=7)
    ax.axhline(1.0, color="tab:green", linestyle="--", linewidth=1, label="expert (1)")
    ax.axhline(0.0, color="gray", linewidth=1)
    ax.set_xticks(range(len(tasks)), [short(t) for t in tasks])
    ax.set_ylabel("normalized score (merged - base) / (expert - base)")
    ax.set_title("normalized score per expert task (best run per method)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)
