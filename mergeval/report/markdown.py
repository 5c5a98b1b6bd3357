"""The Markdown report of a set of runs (pure: text from prepared data)."""

from __future__ import annotations

from mergeval.report.data import Pareto, short


def md_table(rows: list[dict]) -> str:
    """A GitHub-flavoured Markdown table with the rows' keys as header ('|' in cells escaped)."""
    if not rows:
        return "_(none)_"
    cols = list(rows[0])

    def cell(v) -> str:
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def pareto_text(p: Pareto) -> str:
    on_front = ", ".join(f"{p.labels[i]} ({p.points[i][0]:.3f}, {p.points[i][1]:.3f})" for i in p.front)
    if p.area is None:
        area = p.area_note
    else:
        side = ("above the diagonal: merging beats routing each query to one expert" if p.area > 0 else
                "below the diagonal: routing between the experts would do better" if p.area < 0 else
                "on the diagonal")
        area = f"{p.area:+.4f} ({side})"
    return f"Pareto front (merged runs): {on_front}\n\nSynergy area: {area}"


def render(*, title: str, source: str, runs: list[dict], constituents: list[dict], pareto: Pareto | None,
           notes: list[str], param: str | None, normalized: list[dict], images: dict[str, str]) -> str:
    """The whole report; ``images`` maps a plot's name (pareto, score_vs_param, normalized) to its file name."""
    out = [f"# {title}", "", source, "", "## Runs (merged model: each task's metric, value ± stderr)", "", md_table(runs), "",
           "## Base and experts", "", md_table(constituents), ""]
    if pareto is not None:
        out += [f"## Trade-off: {short(pareto.task_x)} vs {short(pareto.task_y)}", "", pareto_text(pareto), ""]
    if "pareto" in images:
        out += [f"![Pareto front]({images['pareto']})", ""]
    if "score_vs_param" in images:
        out += [f"## Score versus {param}", "", f"![score versus {param}]({images['score_vs_param']})", ""]
    out += ["## Normalized score per method", "",
            "normalized = (merged - base) / (expert - base) on each expert's own task: 1 keeps the fine-tune's gain, "
            "0 is back to the base; the best run of each method is shown.", "", md_table(normalized), ""]
    if "normalized" in images:
        out += [f"![normalized scores]({images['normalized']})", ""]
    if notes:
        out += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(out)
