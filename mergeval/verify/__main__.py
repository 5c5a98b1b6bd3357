"""``python -m mergeval.verify SPEC [--run RESULT ...] [--tag T ...] [--claim ID ...] [--strict]
[--recorded NAME ... | --record NAME]``
``python -m mergeval.verify --all [--strict]``

Checks a paper spec (a path, or a name on the spec search path: see
``mergeval/verify/load.py`` and docs/specs.md):

1. Published tables: every derived cell (an average over tasks, an overall
   score over rescaled groups, a plain formula, a normalized score,
   Macro-Gain...) is recomputed from the printed inputs. A number printed with
   d decimals is known to +-0.5*10^-d (or to its column's declared decimals,
   clipped to its declared range; exactly, when marked ``!``); the derived
   value may lie anywhere the inputs' intervals let it, and the printed
   derived value agrees when its own interval meets that range
   (``mergeval/verify/numbers.py``). A cell that does not recompute fails,
   unless the spec records it as the paper's own discrepancy (which number, by
   how much, why) and the record matches what is measured. A cell whose
   rounding window is wider than its table's ``tolerance`` (by default 10
   units of the cell's last printed digit) is "not checkable". Each check is
   labelled by the derivation that made it (``column Avg``, ``row Mean``,
   ``cell [CMM, Avg]``), so a cell that a derived column and a derived row
   both cover is listed once for each.
2. Claims: relations with tolerances between published cells, numbers and the
   results of runs (``--run``: result.json files, or directories holding them,
   e.g. a sweep's multirun directory), and rankings of a table's rows or
   columns. The claim language is documented in docs/specs.md and
   ``mergeval/verify/claims.py``; in short::

       - id: expert_beats_base
         says: each expert beats the base on its own task
         for_each: expert
         left:  {score: {task: "{task}", role: "{expert}"}}
         op: ">"
         right: {score: {task: "{task}", role: base}}
         stderr_margin: 3

   Each claim, and each repetition of it, is "pass", "fail", "undetermined"
   (by rounding: the printed numbers allow it either way), "untestable" (a
   precondition it ``requires`` - an expert learned its skill, there is
   forgetting to measure - does not hold on that run) or "not run" (the runs
   given cannot evaluate it; the reason is printed). A claim on run scores also
   prints its margin: how many standard errors of the difference (paired item
   by item where both sides are run values) it lies from its verdict's
   threshold (positive: on the pass side; ``claims.stderr_units``).
3. Recorded verdicts (``--recorded NAME``): each result the spec recorded
   under ``verdicts: NAME`` is compared with this run's; a changed verdict
   fails when it was recorded at least 1 stderr from its threshold, closer ones
   are reported only (``mergeval/verify/recorded.py``). Given several times
   (records of the same runs on other machines), only the results every record
   holds with the same verdict that far from the threshold are enforced. ``--record NAME``
   prints the ``verdicts:`` block that records this run's results.

``--tag`` / ``--claim`` select the claims (published table checks always run).
``--all`` checks every spec on the search path: its tables and the claims
that need no run, one summary line per spec.

Exit status:
  0  no derived cell disagrees (each agrees, is "not checkable", or is a matching
     recorded discrepancy), and no selected claim fails (with --recorded: no
     enforced recorded verdict changed instead); claims the runs given
     cannot evaluate are listed as "not run", with what would run them, and do
     not count (without ``--run`` that is every claim about runs, so ``verify
     SPEC`` checks what the paper publishes); "undetermined" and "untestable"
     claims and "not checkable" cells are listed and do not count either; with
     ``--strict`` all four are failures (CI uses it with ``--tag`` / ``--claim``
     to select what its runs cover);
  1  otherwise;
  2  a mistake to fix: a missing or invalid spec, an unreadable result.json, an
     unknown tag or claim id, ``--recorded`` or claims selected that are all
     about runs without ``--run`` (one line on stderr naming it).
"""

from __future__ import annotations

import argparse
import sys

from mergeval.core.errors import UserError
from mergeval.verify import ClaimResult, Measured, Run, Spec, available, evaluate_claims, load_runs, load_spec
from mergeval.verify.load import found, search_path
from mergeval.verify.numbers import show_interval
from mergeval.verify.recorded import ENFORCED_MARGIN, Comparison, combine, compare_with, record_block, show_margin
from mergeval.verify.tables import CellCheck

STATUSES = ("pass", "fail", "undetermined", "untestable", "not run")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, like every other user mistake
        print(f"mergeval: error: {message}; see python -m mergeval.verify --help", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m mergeval.verify", description="Check a paper spec's published tables and claims.")
    p.add_argument("spec", nargs="?", help="a spec name (see --list) or a path to a spec YAML")
    p.add_argument(
        "--all", action="store_true", help="check every spec on the search path (tables and claims that need no run)"
    )
    p.add_argument(
        "--run",
        action="append",
        default=None,
        metavar="RESULT",
        help="a result.json, or a directory searched for them (repeatable)",
    )
    p.add_argument("--tag", action="append", default=[], help="check only claims with this tag (repeatable)")
    p.add_argument("--claim", action="append", default=[], metavar="ID", help="check only this claim (repeatable)")
    p.add_argument("--list", action="store_true", help="list the specs on the search path and exit")
    p.add_argument(
        "--strict",
        action="store_true",
        help="a claim not run or undetermined by rounding, or a cell not checkable, fails",
    )
    p.add_argument(
        "--recorded",
        metavar="NAME",
        action="append",
        help="compare with the verdicts the spec recorded as NAME; fail only when one recorded at "
        "least 1 stderr from its threshold changed (repeatable: records of the same runs on "
        "other machines; only what they all hold that far from the threshold is enforced)",
    )
    p.add_argument("--record", metavar="NAME", help="print the verdicts: block that records this run's results")
    return p


def select_claims(spec: Spec, tags: list[str], ids: list[str]):
    """The claims chosen by --tag / --claim (all when neither is given); UserError for unknown ones."""
    known_ids = {c.id for c in spec.claims}
    known_tags = sorted({t for c in spec.claims for t in c.tags})
    for cid in ids:
        if cid not in known_ids:
            raise UserError("--claim", f"spec {spec.name} has no claim '{cid}'", f"choose from {sorted(known_ids)}")
    for tag in tags:
        if tag not in known_tags:
            raise UserError(
                "--tag", f"no claim of spec {spec.name} has tag '{tag}'", f"tags in this spec: {known_tags}"
            )
    if not tags and not ids:
        return list(spec.claims)
    return [c for c in spec.claims if c.id in ids or set(c.tags) & set(tags)]


def refuse_checking_nothing(args, claims) -> None:
    """Without ``--run``, a command that could only check runs (a record to hold runs to, claims selected that all
    need runs) would end "not run" with exit 0 as though it had checked something: one line instead."""
    if args.run is not None:
        return
    if args.recorded:
        raise UserError(
            "--recorded",
            "compares runs with a record, and no --run is given",
            "add --run RESULT (a result.json or a sweep's directory) of the recorded setup",
        )
    if (args.tag or args.claim) and claims and all(c.uses_runs for c in claims):
        raise UserError(
            "--run",
            f"the {len(claims)} claim(s) selected are all about runs, and no --run is given",
            "add --run RESULT (a result.json or a sweep's directory), or select published claims",
        )


def refuse_unusable_runs(spec_name: str, runs, results: list[ClaimResult]) -> None:
    """Runs given that evaluate none of the spec's run claims are the wrong runs (another spec's, a sweep not
    yet run): said in one line, where the report would end in exit 0 with every run claim "not run"."""
    using = [r for r in results if r.uses_runs]
    if runs is None or not using or any(r.status != "not run" for r in using):
        return
    raise UserError(
        "--run",
        f"the {len(runs)} run(s) given evaluate none of spec {spec_name}'s {len(using)} run "
        f"claim checks (the first: {using[0].detail or 'no matching run'})",
        f"give runs of {spec_name}'s setups (python -m mergeval.verify {spec_name} lists what each "
        "claim needs), or the spec these runs belong to",
    )


def exit_status(checks: list[CellCheck], results: list[ClaimResult], strict: bool) -> int:
    """0 or 1 as the module docstring defines it."""
    if any(c.failed for c in checks) or any(r.status == "fail" for r in results):
        return 1
    unsure = any(not c.ok for c in checks) or any(r.status != "pass" for r in results)
    return 1 if strict and unsure else 0


def _fmt(m: Measured | None) -> str:
    if m is None:
        return "-"
    if m.text is not None:
        return m.text
    return f"{m.value:.4g}" + (f"±{m.stderr:.2g}" if m.stderr else "")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _setup_lines(spec: Spec) -> list[str]:
    """Each setup's experiment and the methods the paper compares, as mergeval runs them (or why it cannot)."""
    lines = []
    for name, setup in spec.setups.items():
        methods = setup.get("methods") if isinstance(setup, dict) else None
        if not isinstance(methods, dict):
            continue
        shown = []
        for label, entry in methods.items():
            if not isinstance(entry, dict) or "mergeval" not in entry:
                continue
            target = entry.get("preset") or entry["mergeval"]
            shown.append(f"{label} -> {target}" if target else f"{label} -> (not in mergeval)")
        if shown:
            lines.append(f"setup {name} (+experiment={setup.get('experiment')}): " + "; ".join(shown))
    return lines


def report(
    spec: Spec, checks: list[CellCheck], results: list[ClaimResult], runs: list[Run] | None, strict: bool = False
) -> str:
    cite = ", ".join(str(spec.citation[k]) for k in ("authors", "venue") if spec.citation.get(k))
    out = [f"{spec.name}: {spec.title}" + (f" ({cite})" if cite else "")]
    out += _setup_lines(spec)
    out.append(f"\npublished tables: {len(checks)} derived cells")
    if checks:
        out.append(
            _table(
                ["cell (table / row / column)", "derivation", "printed", "recomputed", "rounding allows", "verdict"],
                [
                    [
                        " / ".join(c.at),
                        _short(f"{c.origin}: {c.kind}" if c.origin else c.kind, 60),
                        c.printed.text,
                        f"{c.recomputed:.6g}",
                        show_interval(c.lo, c.hi),
                        c.status + (f": {c.detail}" if c.detail else ""),
                    ]
                    for c in checks
                ],
            )
        )
    runs_given = runs is not None
    if runs:
        out.append(f"\nruns: {len(runs)}")
        out.append(
            _table(
                ["run", "method", "modelset", "result"],
                [[str(r.index), r.label, str(r.config.get("modelset", {}).get("name", "?")), r.path] for r in runs],
            )
        )
    source = f"{len(runs)} run(s)" if runs is not None else "no --run given"
    out.append(f"\nclaims: {len(results)} checks ({source})")
    if results:
        margins = any(r.margin is not None for r in results)
        out.append(
            _table(
                ["claim", "verdict"] + (["margin (se)"] if margins else []) + ["left", "op", "right", "detail"],
                [
                    [r.id, r.status]
                    + ([show_margin(r.margin)] if margins else [])
                    + [_fmt(r.left), r.op, _fmt(r.right), r.detail]
                    for r in results
                ],
            )
        )
    out += power_lines(spec, results)
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    if not counts["not run"]:
        note = ""
    elif not runs_given:
        note = " (they need runs: --run result.json or a sweep directory)"
    else:
        note = " (the runs given cannot evaluate them: add runs that match, see each detail; " + (
            "--strict counts them as failures)" if strict else "not counted; --strict fails on them)"
        )
    code = exit_status(checks, results, strict)
    out.append(f"\nverdict: {summary(checks, results)}{note} -> exit {code}")
    return "\n".join(out)


DECIDED_BY = 2.0  # a central finding is decided when its verdict is this many stderrs from its threshold


def power_lines(spec: Spec, results: list[ClaimResult]) -> list[str]:
    """For the central findings (tag ``central``) that are not decided by DECIDED_BY stderrs, and the
    preconditions (claims others require) that fall short of their margin: how many items per task would
    settle them if the effect stays as measured (metrics/paired.py)."""
    from mergeval.metrics.paired import items_to_decide, items_to_pass

    claims = {c.id: c for c in spec.claims}
    required = {need for c in spec.claims for need in c.requires}
    lines = []
    for r in results:
        claim = claims.get(r.claim)
        forms = [m.form for m in (r.left, r.right) if m is not None and m.form is not None]
        n = max((f.items for f in forms), default=0)
        margin = r.own_margin if r.status == "untestable" else r.margin  # what the claim itself measured
        if claim is None or margin is None or not n:
            continue
        if "central" in claim.tags and abs(margin) < DECIDED_BY:
            need = items_to_decide(margin, claim.stderr_margin, n, DECIDED_BY)
            lines.append(
                f"  central finding {r.id}: {margin:+.2f} se on {n} items per task; "
                + (
                    f"about {need} would decide it by {DECIDED_BY:g} se"
                    if need
                    else "no effect measured: no number of items decides it"
                )
                + " (the effect as measured)"
            )
        elif r.claim in required and margin < 0:
            need = items_to_pass(margin, claim.stderr_margin, n)
            lines.append(
                f"  precondition {r.id}: {margin:+.2f} se on {n} items per task; "
                + (
                    f"about {need} would let it hold by {claim.stderr_margin:g} se"
                    if need
                    else "its effect is not on the pass side"
                )
                + " (the effect as measured)"
            )
    return ["\npower (items per task that would settle what this run does not):", *lines] if lines else []


def recorded_report(name: str, comparisons: list[Comparison]) -> str:
    """The comparison with a record: one row per recorded result, then a summary line."""
    rows = [
        [
            c.id,
            f"{c.recorded.verdict} {show_margin(c.recorded.margin)}",
            "-" if c.now is None else f"{c.now.status} {show_margin(c.now.margin)}",
            c.status + (" (enforced)" if c.recorded.enforced else " (not enforced)"),
        ]
        for c in comparisons
    ]
    changed = [c for c in comparisons if c.status != "same"]
    enforced = sum(c.recorded.enforced for c in comparisons)
    return "\n".join(
        [
            f"\nrecorded verdicts '{name}': {len(comparisons)} results",
            _table(["claim", "recorded (margin)", "now (margin)", "comparison"], rows),
            f"recorded '{name}': {len(comparisons) - len(changed)} same, {len(changed)} changed "
            f"({sum(c.counts for c in changed)} of them enforced); {enforced} of the {len(comparisons)} "
            f"results are enforced (recorded at least {ENFORCED_MARGIN:g} stderr from the threshold): "
            "a change among them fails the check",
        ]
    )


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def summary(checks: list[CellCheck], results: list[ClaimResult]) -> str:
    """One line: how many derived cells agree (and the other cell verdicts), and the claims by verdict."""
    agree = sum(c.ok for c in checks)
    others = {s: sum(c.status == s for c in checks) for s in ("disagree", "record-wrong", "not checkable")}
    cells = f"{agree}/{len(checks)} derived cells agree" + "".join(f", {n} {s}" for s, n in others.items() if n)
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    undetermined = f", {counts['undetermined']} undetermined by rounding" if counts["undetermined"] else ""
    untestable = f", {counts['untestable']} untestable" if counts["untestable"] else ""
    return (
        f"{cells}; claims {counts['pass']} pass, {counts['fail']} fail{undetermined}{untestable}, "
        f"{counts['not run']} not run"
    )


def check_all(strict: bool) -> int:
    """``--all``: every spec on the search path, tables and the claims that need no run; one line each, and the
    cells and claims that are not a pass under it. Exit 2 if a spec is invalid, else 1 if one fails, else 0."""
    worst = 0
    for name, path in found().items():
        try:
            spec = load_spec(str(path))
            checks = spec.check_tables()
            published = [c for c in spec.claims if not c.uses_runs]
            results = evaluate_claims(spec.claims, published, None, spec.tables, spec.metrics)
        except UserError as err:
            print(f"{name}: {err.line()}")
            worst = 2
            continue
        code = exit_status(checks, results, strict)
        worst = max(worst, code)
        need_runs = sum(c.uses_runs for c in spec.claims)
        print(
            f"{name}: {summary(checks, results)} ({need_runs} claims on runs not checked here) -> "
            f"{'ok' if code == 0 else 'FAIL'}  ({path})"
        )
        for c in checks:
            if not c.ok:
                print(f"  cell {' / '.join(c.at)} ({c.origin}): {c.status}: {c.detail}")
        for r in results:
            if r.status != "pass":
                print(f"  claim {r.id}: {r.status}: {r.detail}")
    if not found():
        print("no specs found on the search path: " + ", ".join(map(str, search_path())))
    return worst


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.list:
            print("\n".join(f"{name}  {path}" for name, path in found().items()))
            return 0
        if args.all:
            if args.spec or args.run or args.tag or args.claim:
                raise UserError(
                    "--all",
                    "checks every spec's tables and published claims on its own",
                    "drop the spec, --run, --tag and --claim, or drop --all",
                )
            return check_all(args.strict)
        if args.spec is None:
            raise UserError("spec", "no spec given", f"name one of: {', '.join(available())}")
        spec = load_spec(args.spec)
        claims = select_claims(spec, args.tag, args.claim)
        runs = load_runs(args.run) if args.run is not None else None
        checks = spec.check_tables()
        refuse_checking_nothing(args, claims)
        results = evaluate_claims(spec.claims, claims, runs, spec.tables, spec.metrics)
        refuse_unusable_runs(spec.name, runs, results)
        for name in args.recorded or []:
            if name not in spec.verdicts:
                raise UserError(
                    "--recorded",
                    f"spec {spec.name} records no verdicts named '{name}'",
                    f"choose from {sorted(spec.verdicts)}, or record them with --record",
                )
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return 2
    if args.record is not None:
        print(record_block(args.record, " ".join(["python -m mergeval.verify", *(argv or sys.argv[1:])]), results))
        return 0
    print(report(spec, checks, results, runs, args.strict))
    if args.recorded is None:
        return exit_status(checks, results, args.strict)
    record = combine([spec.verdicts[name] for name in args.recorded])
    comparisons = compare_with(record, results)
    print(recorded_report(record.name, comparisons))
    # Held to the record: a claim's own fail is expected when recorded so; what fails is an enforced change.
    return 1 if any(c.failed for c in checks) or any(c.counts for c in comparisons) else 0


if __name__ == "__main__":
    sys.exit(main())
