"""Claims over a whole row or column of a published table, computed from the table as it stands.

A *line* is one column of a table read down its rows, or one row read across
its columns, minus the names in ``except`` (blank cells are skipped)::

    {table: general_domain, col: Avg}                    # every row's Avg
    {table: general_domain, col: Avg, except: [TA]}      # every row's Avg but TA's
    {table: chembench, row: CMM, except: [Average]}      # CMM's cells in every column but Average

Three things read a line; none lists its members, so a row added to the table
later is included (the claim gets stronger, never silently weaker):

- the operands ``{max: LINE}`` / ``{min: LINE}``: the largest / smallest cell,
  its interval [max lo_i, max hi_i] (resp. min);
- the claims ``argmax: LINE, is: NAME`` / ``argmin`` and ``rank: LINE`` with
  ``first: NAME`` / ``last: NAME`` (``best: low`` when lower is better);
- ``for_each: {var: {rows: T, except: [..]}}`` or ``{var: {columns: T, ..}}``,
  repeating a claim for every row (column) of T.

Derived summaries are not members: a row that the table's ``derived_rows``
computes (an "Average" or "Mean of merges" row) is left out of every line down
a column and of ``for_each`` over rows, and a column that ``derived`` computes
("Avg", "Δ Base") is left out of every line across a row and of ``for_each``
over columns. They are functions of the members, not rivals of them: an
average row ranked like a method could be "best" or "last" in its place, and
"for every benchmark" does not mean the average column. (``except`` may still
name them; a cell reference ``{table, row, col}`` still reads them.) A cell of
``derived_cells`` does not make its row or column a summary.

Rounding: NAME is first when its true value is above every other member's.
With each cell known only to its interval, that is

    pass          lo_NAME > hi_j for every other j   (whatever the rounding hid)
    fail          hi_NAME <= lo_j for some j         (j is at least as good, whatever the rounding hid)
    undetermined  otherwise: a rounding tie with the members named in the detail
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mergeval.core.errors import UserError
from mergeval.verify.numbers import Interval, Printed
from mergeval.verify.runs import Measured
from mergeval.verify.tables import Table, line, match_name, name_text, show

_LINE_KEYS = {"table", "col", "row", "except"}


@dataclass(frozen=True)
class Line:
    table: str
    col: str | None = None
    row: str | None = None
    without: tuple[str, ...] = ()

    def strings(self) -> list[str]:
        return [s for s in (self.table, self.col, self.row, *self.without) if s]

    def fill(self, fill: Callable[[str], str]) -> Line:
        return Line(
            fill(self.table),
            self.col and fill(self.col),
            self.row and fill(self.row),
            tuple(fill(w) for w in self.without),
        )

    def describe(self) -> str:
        axis = f"column {self.col}" if self.col is not None else f"row {self.row}"
        return f"{self.table} {axis}" + (f" except {', '.join(self.without)}" if self.without else "")


def _text(raw: Any) -> str:
    text = name_text(raw)
    return text if text is not None else str(raw)


def parse_line(raw: Any, field: str) -> Line:
    """A Line from {table, col | row, except}; names are matched when the claim is checked against the tables."""
    if not isinstance(raw, Mapping) or set(raw) - _LINE_KEYS or "table" not in raw or ("col" in raw) == ("row" in raw):
        raise UserError(
            field,
            f"{raw!r} is not a line of a table",
            "write {table: T, col: C} (down a column) or {table: T, row: R} (across a row), "
            "optionally with except: [..]",
        )
    without = raw.get("except") or []
    if not isinstance(without, list):
        raise UserError(f"{field}.except", "must be a list of names", "write except: [TA]")
    return Line(
        str(raw["table"]),
        _text(raw["col"]) if "col" in raw else None,
        _text(raw["row"]) if "row" in raw else None,
        tuple(_text(w) for w in without),
    )


def members(spec: Line, tables: Mapping[str, Table], field: str) -> list[tuple[str, Printed, Interval]]:
    """The line's cells; UserError for an unknown table, row, column or ``except`` name, or fewer than 2 cells."""
    if spec.table not in tables:
        raise UserError(field, f"refers to unknown table '{spec.table}'", f"use one of {sorted(tables)}")
    table = tables[spec.table]
    along, across = (table.columns, table.rows) if spec.col is not None else (table.rows, table.columns)
    name = spec.col if spec.col is not None else spec.row
    assert name is not None, "a line is down a column or across a row (parse_line)"
    fixed = match_name(along, name)
    if fixed is None:
        what = "column" if spec.col is not None else "row"
        raise UserError(field, f"table '{table.name}' has no {what} {show(name)}", f"use one of {along}")
    without = []
    for name in spec.without:
        known = match_name(across, name)
        if known is None:
            raise UserError(
                f"{field}.except", f"table '{table.name}' has no {show(name)} to leave out", f"use names from {across}"
            )
        without.append(known)
    without += sorted(table.derived("rows" if spec.col is not None else "columns"))  # summaries: module docstring
    cells = line(table, col=fixed, without=without) if spec.col is not None else line(table, row=fixed, without=without)
    if len(cells) < 2:
        raise UserError(field, f"{spec.describe()} has {len(cells)} printed cell(s)", "a line needs 2 or more")
    return cells


def measured(name: str, printed: Printed, box: Interval) -> Measured:
    return Measured(printed.value, text=f"{printed.text} ({name})", lo=box[0], hi=box[1])


def extreme(how: str, cells: Sequence[tuple[str, Printed, Interval]]) -> Measured:
    """max / min of a line: the extreme printed cell, with interval [max lo_i, max hi_i] (resp. min)."""
    pick = max if how == "max" else min
    name, printed, _ = pick(cells, key=lambda c: c[1].value)
    return replace(
        measured(name, printed, (0.0, 0.0)), lo=pick(c[2][0] for c in cells), hi=pick(c[2][1] for c in cells)
    )


def quantifier_values(raw: Any, tables: Mapping[str, Table], field: str) -> list[str] | None:
    """for_each {rows: T, except: [..]} / {columns: T, ..} -> the names; None if ``raw`` is no quantifier."""
    if not isinstance(raw, Mapping) or not ({"rows", "columns"} & set(raw)):
        return None
    if set(raw) - {"rows", "columns", "except"} or len({"rows", "columns"} & set(raw)) != 1:
        raise UserError(field, f"{raw!r} is not a quantifier", "write {rows: T} or {columns: T}, with except: [..]")
    axis = "rows" if "rows" in raw else "columns"
    name = str(raw[axis])
    if name not in tables:
        raise UserError(f"{field}.{axis}", f"unknown table '{name}'", f"use one of {sorted(tables)}")
    names = getattr(tables[name], axis)
    without = raw.get("except") or []
    if not isinstance(without, list):
        raise UserError(f"{field}.except", "must be a list of names", "write except: [Average]")
    left_out = []
    for w in without:
        known = match_name(names, w)
        if known is None:
            raise UserError(
                f"{field}.except", f"table '{name}' has no {axis[:-1]} {show(_text(w))}", f"use names from {names}"
            )
        left_out.append(known)
    summaries = tables[name].derived(axis)  # derived rows / columns are not members (module docstring)
    return [n for n in names if n not in left_out and n not in summaries]


def rank_verdict(
    cells: Sequence[tuple[str, Printed, Interval]], who: str, place: str, best: str = "high"
) -> tuple[str, str, Measured, Measured]:
    """Whether ``who`` is first / last of the line (module docstring); (status, detail, who, its nearest rival).

    ``place`` first means best; ``best`` high means larger is better. The
    comparison is made on scores s = +-value so that "first" is always "highest s".
    """
    sign = 1.0 if (place == "first") == (best == "high") else -1.0

    def score(box: Interval) -> Interval:
        return (box[0], box[1]) if sign > 0 else (-box[1], -box[0])

    by_name = {name: (printed, box) for name, printed, box in cells}
    mine = score(by_name[who][1])
    rivals = [(name, score(box)) for name, _, box in cells if name != who]
    beaten_by = [name for name, s in rivals if mine[1] <= s[0]]
    ties = [name for name, s in rivals if not mine[0] > s[1] and name not in beaten_by]
    nearest = max(rivals, key=lambda r: (r[1][1], r[1][0]))[0]
    rival = beaten_by[0] if beaten_by else ties[0] if ties else nearest
    who_m = measured(who, *by_name[who])
    rival_m = measured(rival, *by_name[rival])
    if beaten_by:
        return (
            "fail",
            f"{', '.join(beaten_by)} {'is' if len(beaten_by) == 1 else 'are'} at least as good",
            who_m,
            rival_m,
        )
    if ties:
        return ("undetermined", f"a rounding tie with {', '.join(ties)}: their intervals overlap", who_m, rival_m)
    return (
        "pass",
        f"{'ahead of' if place == 'first' else 'behind'} the other {len(rivals)}; next: {nearest}",
        who_m,
        rival_m,
    )
