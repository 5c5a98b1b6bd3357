"""The README's plots of two mini reproductions (issue 17), drawn from a sweep's result.json files.

    python benchmarks/reproduction_plots.py medical_hier multirun/<date>/<time> docs/medical_hier_mini.png
    python benchmarks/reproduction_plots.py cpt_finance  multirun/<date>/<time> docs/cpt_finance_mini.png

medical_hier: per task, each method's merged accuracy +- stderr as grouped bars, the base and each parent as
horizontal marks (the paper's Table IV as a picture). cpt_finance: per merge (each pair and the triple),
Macro-Gain (solid) and Macro-OG (dashed) versus lambda for task arithmetic and TIES, the paper's two metrics,
with the merged task average's stderr as the error bar (within one merge the constituents are fixed, so
Macro-Gain moves exactly as the merged average does).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from matplotlib.figure import Figure


def load(sweep: Path) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in sorted(sweep.rglob("result.json"))]
    if not runs:
        raise SystemExit(f"reproduction_plots: no result.json under {sweep}")
    return runs


def method_label(run: dict) -> str:
    method = run["config"]["method"]
    if method["name"] in ("dare_ties", "della", "breadcrumbs", "ties"):
        return f"{method['name']} {method['density']:g}"
    return method["name"]


def short(task: str) -> str:
    return task.removeprefix("mergeval_")


def plot_medical(runs: list[dict], path: Path) -> None:
    tasks = list(runs[0]["scores"])
    fig = Figure(figsize=(11, 4.2))
    ax = fig.add_subplot()
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(tasks))]
        merged = [run["scores"][t]["merged"] for t in tasks]
        ax.bar(xs, [m["value"] for m in merged], width=width, yerr=[m["stderr"] for m in merged], capsize=2,
               label=method_label(run))
    roles = [m["role"] for m in runs[0]["models"] if m["role"] != "merged"]
    styles = {"base": ("gray", ":")} | {r: (c, "--") for r, c in zip(roles[1:], ("black", "tab:brown"))}
    for i, task in enumerate(tasks):
        for role in roles:
            color, style = styles[role]
            ax.plot([i - 0.45, i + 0.45], [runs[0]["scores"][task][role]["value"]] * 2, color=color, linestyle=style,
                    linewidth=1.5, label=role if i == 0 else None)
    ax.set_xticks(range(len(tasks)), [short(t) for t in tasks])
    ax.set_ylabel("accuracy ± stderr")
    ax.set_ylim(0, 1.05)
    ax.set_title("medical_hier mini: merged accuracy per task (lines: base and parents)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=120, format="png", bbox_inches="tight")


def merged_avg_stderr(run: dict) -> float:
    """Stderr of the merged task average in points: 100 sqrt(sum_t se_t^2) / T."""
    ses = [by_role["merged"]["stderr"] for by_role in run["scores"].values()]
    return 100 * math.sqrt(sum(se * se for se in ses)) / len(ses)


def plot_cpt(runs: list[dict], path: Path) -> None:
    modelsets = sorted({r["config"]["modelset"]["name"] for r in runs}, key=lambda m: (m.count("_"), m))
    fig = Figure(figsize=(4 * len(modelsets), 3.8))
    axes = fig.subplots(1, len(modelsets), sharey=True, squeeze=False)[0]
    for ax, modelset in zip(axes, modelsets):
        for method, color in (("task_arithmetic", "tab:blue"), ("ties", "tab:orange")):
            chosen = sorted((r for r in runs if r["config"]["modelset"]["name"] == modelset
                             and r["config"]["method"]["name"] == method), key=lambda r: r["config"]["method"]["lambda_"])
            xs = [r["config"]["method"]["lambda_"] for r in chosen]
            ax.errorbar(xs, [r["aggregates"]["macro_gain"] for r in chosen], yerr=[merged_avg_stderr(r) for r in chosen],
                        color=color, marker="o", capsize=3, label=f"{method} Macro-Gain")
            ax.plot(xs, [r["aggregates"]["macro_og"] for r in chosen], color=color, marker="x", linestyle="--",
                    label=f"{method} Macro-OG")
        one = next(r for r in runs if r["config"]["modelset"]["name"] == modelset)
        ax.set_title(" + ".join(one["config"]["modelset"]["experts"]), fontsize=10)
        ax.axhline(0, color="gray", linewidth=1)
        ax.set_xlabel("lambda")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("points")
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle("cpt_finance mini: Macro-Gain / Macro-OG versus lambda (error bar: merged average's stderr)",
                 fontsize=10)
    fig.savefig(path, dpi=120, format="png", bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paper", choices=["medical_hier", "cpt_finance"])
    parser.add_argument("sweep", type=Path, help="the mini reproduction's multirun directory")
    parser.add_argument("out", type=Path, help="the PNG to write")
    args = parser.parse_args(argv)
    (plot_medical if args.paper == "medical_hier" else plot_cpt)(load(args.sweep), args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
