"""Recorded verdicts: what a spec's claims gave on a named run, so a later run can be held to it.

A spec may record, under ``verdicts:``, the verdict and margin of each claim
result on a run it names::

    verdicts:
      mini:                                   # a record's name (verify --recorded mini)
        run: "python -m mergeval +experiment=cmm_mini (2026-12-01, 2-core AMD EPYC)"
        claims:
          mini_curriculum_beats_reverse: pass +2.31
          mini_cmm_beats_experts (expert=chem): fail -0.42
          cmm_best_general_average: pass       # no margin: published cells carry no stderr

A claim result's id is as ``verify`` prints it (repetitions in brackets). The
margin is ``ClaimResult.margin`` (``claims.stderr_units``): how many combined
stderrs the result lies from its verdict's threshold, positive on the pass side.

Comparing a new run with a record (``compare_with``): each recorded result is
``same`` (the verdict did not change), ``changed`` or ``missing`` (the new run
has no such result). A change counts (``enforced``) only when the recorded
verdict held with a margin of at least ``ENFORCED_MARGIN`` stderr, or without
stderr at all: scores move between CPU families by a stderr or so, so a verdict
closer than that to its threshold may flip without anything being wrong. Closer
ones are reported, not enforced. ``python -m mergeval.verify SPEC --run R
--recorded NAME`` prints the comparison and exits 1 on an enforced change;
``--record NAME`` prints the block to paste for a new record.

Several records of the same runs on different machines (``--recorded A
--recorded B``; ``combine``) hold a new run to what they agree on: a result
is enforced only when every record has it with the same verdict, each at
least ``ENFORCED_MARGIN`` stderr from the threshold (the smallest margin is
shown); where they disagree the result is reported as, e.g., ``fail / pass``
and any of those verdicts counts as the same. One machine's margin is not a
promise about another's: the CMM mini's reduced run ranks two experts one
validation item apart, and another CPU family swapped them, which moved
every CMM margin by up to 1.8 stderr (README "Reproductions at small scale").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from mergeval.core.errors import UserError
from mergeval.verify.claims import ClaimResult

ENFORCED_MARGIN = 1.0
VERDICTS = ("pass", "fail", "undetermined", "untestable", "not run")
_ENTRY = re.compile(r"^(pass|fail|undetermined|untestable|not run)(?:\s+([+-]?\d+(?:\.\d*)?))?$")


@dataclass(frozen=True)
class Recorded:
    verdict: str  # several records that disagree: their verdicts joined by " / " (``combine``)
    margin: float | None  # stderrs from the threshold when recorded; None: no stderr (exact)
    agreed: bool = True  # False: combined from records that disagree, or that do not all have this result

    @property
    def enforced(self) -> bool:
        return (
            self.agreed and self.verdict != "not run" and (self.margin is None or abs(self.margin) >= ENFORCED_MARGIN)
        )

    def allows(self, verdict: str) -> bool:
        return verdict in self.verdict.split(" / ")


@dataclass(frozen=True)
class Record:
    name: str
    run: str  # how the recorded run was made (command, date, machine)
    claims: dict[str, Recorded]


@dataclass(frozen=True)
class Comparison:
    id: str
    recorded: Recorded
    now: ClaimResult | None

    @property
    def status(self) -> str:
        if self.now is None:
            return "missing"
        return "same" if self.recorded.allows(self.now.status) else "changed"

    @property
    def counts(self) -> bool:
        """A difference that fails the check: an enforced verdict changed or is no longer produced."""
        return self.status != "same" and self.recorded.enforced


def parse_records(raw, where: str) -> dict[str, Record]:
    """The spec's ``verdicts:`` mapping; UserError naming the entry for anything malformed."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise UserError(
            where,
            "must map record names to {run: .., claims: {..}}",
            "write verdicts: {mini: {run: '<command>', claims: {<claim id>: pass +2.1}}}",
        )
    records = {}
    for name, body in raw.items():
        at = f"{where}.{name}"
        if (
            not isinstance(body, Mapping)
            or set(body) - {"run", "claims"}
            or not isinstance(body.get("claims"), Mapping)
        ):
            raise UserError(
                at,
                "must be {run: <how the run was made>, claims: {<claim result id>: <verdict> [margin]}}",
                "see mergeval/verify/recorded.py",
            )
        claims = {}
        for cid, entry in body["claims"].items():
            match = _ENTRY.match(str(entry).strip())
            if not match:
                raise UserError(
                    f"{at}.claims.{cid}",
                    f"'{entry}' is not '<verdict> [margin]'",
                    f"write one of {', '.join(VERDICTS)}, then the margin in stderrs if it has one (e.g. pass +2.31)",
                )
            claims[str(cid)] = Recorded(match.group(1), float(match.group(2)) if match.group(2) else None)
        records[str(name)] = Record(str(name), str(body.get("run") or ""), claims)
    return records


def combine(records: list[Record]) -> Record:
    """One record holding what ``records`` (the same runs on other machines) agree on (module docstring)."""
    if len(records) == 1:
        return records[0]
    ids = list(dict.fromkeys(cid for r in records for cid in r.claims))
    claims = {}
    for cid in ids:
        entries = [r.claims.get(cid) for r in records]
        verdicts = sorted({e.verdict for e in entries if e is not None})
        margins = [e.margin for e in entries if e is not None and e.margin is not None]
        margin = min(margins, key=abs) if margins else None
        agreed = len(verdicts) == 1 and None not in entries
        claims[cid] = Recorded(" / ".join(verdicts), margin if agreed else None, agreed)
    return Record(" + ".join(r.name for r in records), "; ".join(r.run for r in records), claims)


def compare_with(record: Record, results: list[ClaimResult]) -> list[Comparison]:
    """Each recorded result against the new results of the same id (recorded order)."""
    now = {r.id: r for r in results}
    return [Comparison(cid, rec, now.get(cid)) for cid, rec in record.claims.items()]


def show_margin(margin: float | None) -> str:
    return "-" if margin is None else f"{margin:+.2f}"


def record_block(name: str, run: str, results: list[ClaimResult]) -> str:
    """The YAML to paste under a spec's ``verdicts:`` to record these results as ``name``."""
    lines = [f"  {name}:", f"    run: {_quote(run)}", "    claims:"]
    for r in results:
        entry = r.status + (f" {show_margin(r.margin)}" if r.margin is not None else "")
        lines.append(f"      {_quote(r.id)}: {entry}")
    return "\n".join(lines)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
