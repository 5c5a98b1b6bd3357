"""The README's plots of the mini reproductions (issue 17), drawn from a sweep's result.json files.

    python benchmarks/reproduction_plots.py cmm_chem     multirun/<date>/<time> docs/cmm_mini_pareto.png
    python benchmarks/reproduction_plots.py mergebench   multirun/<date>/<time> docs/mergebench_mini_normalized.png
    python benchmarks/reproduction_plots.py medical_hier multirun/<date>/<time> docs/medical_hier_mini.png
    python benchmarks/reproduction_plots.py cpt_finance  multirun/<date>/<time> docs/cpt_finance_mini.png

cmm_chem: each merge's accuracy on the two competing unit tasks (unit_convert against unit_reduce), the
experts and the base as stars. mergebench: per expert task, each method's normalized score
(merged - base) / (expert - base) as grouped bars.

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
    """Each job's result.json in job order, with ``choice``: the method option the sweep chose (its
    ``.hydra/hydra.yaml``; e.g. cmm_chem/reverse, mergebench/soup), else the method's name."""
    import yaml

    from mergeval.core.paths import result_files_below

    runs = []
    for path in result_files_below(sweep):
        run = json.loads(path.read_text())
        hydra = path.parent / ".hydra" / "hydra.yaml"
        choices = yaml.safe_load(hydra.read_text())["hydra"]["runtime"]["choices"] if hydra.exists() else {}
        run["choice"] = choices.get("method") or run["config"]["method"]["name"]
        runs.append(run)
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
        ax.bar(
            xs,
            [m["value"] for m in merged],
            width=width,
            yerr=[m["stderr"] for m in merged],
            capsize=2,
            label=method_label(run),
        )
    roles = [m["role"] for m in runs[0]["models"] if m["role"] != "merged"]
    styles = {"base": ("gray", ":")} | {r: (c, "--") for r, c in zip(roles[1:], ("black", "tab:brown"))}
    for i, task in enumerate(tasks):
        for role in roles:
            color, style = styles[role]
            ax.plot(
                [i - 0.45, i + 0.45],
                [runs[0]["scores"][task][role]["value"]] * 2,
                color=color,
                linestyle=style,
                linewidth=1.5,
                label=role if i == 0 else None,
            )
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
            chosen = sorted(
                (
                    r
                    for r in runs
                    if r["config"]["modelset"]["name"] == modelset and r["config"]["method"]["name"] == method
                ),
                key=lambda r: r["config"]["method"]["lambda_"],
            )
            xs = [r["config"]["method"]["lambda_"] for r in chosen]
            ax.errorbar(
                xs,
                [r["aggregates"]["macro_gain"] for r in chosen],
                yerr=[merged_avg_stderr(r) for r in chosen],
                color=color,
                marker="o",
                capsize=3,
                label=f"{method} Macro-Gain",
            )
            ax.plot(
                xs,
                [r["aggregates"]["macro_og"] for r in chosen],
                color=color,
                marker="x",
                linestyle="--",
                label=f"{method} Macro-OG",
            )
        one = next(r for r in runs if r["config"]["modelset"]["name"] == modelset)
        ax.set_title(" + ".join(one["config"]["modelset"]["experts"]), fontsize=10)
        ax.axhline(0, color="gray", linewidth=1)
        ax.set_xlabel("lambda")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("points")
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(
        "cpt_finance mini: Macro-Gain / Macro-OG versus lambda (error bar: merged average's stderr)", fontsize=10
    )
    fig.savefig(path, dpi=120, format="png", bbox_inches="tight")


def plot_cmm(runs: list[dict], path: Path) -> None:
    x_task, y_task = "mergeval_unit_convert", "mergeval_unit_reduce"
    fig = Figure(figsize=(5.5, 4.6))
    ax = fig.add_subplot()
    first = runs[0]["scores"]
    for role in [m["role"] for m in runs[0]["models"] if m["role"] != "merged"]:
        ax.scatter(first[x_task][role]["value"], first[y_task][role]["value"], marker="*", s=140, color="gray")
        ax.annotate(
            role,
            (first[x_task][role]["value"], first[y_task][role]["value"]),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    for run in runs:
        x, y = run["scores"][x_task]["merged"], run["scores"][y_task]["merged"]
        ax.errorbar(
            x["value"], y["value"], xerr=x["stderr"], yerr=y["stderr"], marker="o", capsize=3, label=run["choice"]
        )
    ax.set_xlabel(f"{short(x_task)} accuracy")
    ax.set_ylabel(f"{short(y_task)} accuracy")
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("cmm mini: the two competing unit skills per merge (stars: base, experts)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, format="png", bbox_inches="tight")


def normalized(run: dict, task: str, expert: str) -> float:
    """(merged - base) / (expert - base) on ``task``; nan when the expert does not beat the base."""
    s = run["scores"][task]
    gap = s[expert]["value"] - s["base"]["value"]
    return (s["merged"]["value"] - s["base"]["value"]) / gap if gap > 0 else float("nan")


def plot_mergebench(runs: list[dict], path: Path) -> None:
    experts = {m["role"]: m for m in runs[0]["models"] if m["role"] not in ("base", "merged")}
    owned = [(role, runs[0]["config"]["modelset"]["experts"][role]["task"]) for role in experts]
    fig = Figure(figsize=(11, 4.2))
    ax = fig.add_subplot()
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(owned))]
        ax.bar(xs, [normalized(run, task, role) for role, task in owned], width=width, label=run["choice"])
    ax.axhline(0, color="gray", linewidth=1)
    ax.axhline(1, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(owned)), [f"{short(task)}\n({role})" for role, task in owned])
    ax.set_ylabel("normalized score (0 = base, 1 = expert)")
    ax.set_title("mergebench mini: each method's normalized score per expert task", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=120, format="png", bbox_inches="tight")


PLOTS = {"cmm_chem": plot_cmm, "mergebench": plot_mergebench, "medical_hier": plot_medical, "cpt_finance": plot_cpt}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paper", choices=sorted(PLOTS))
    parser.add_argument("sweep", type=Path, help="the mini reproduction's multirun directory")
    parser.add_argument("out", type=Path, help="the PNG to write")
    args = parser.parse_args(argv)
    PLOTS[args.paper](load(args.sweep), args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
