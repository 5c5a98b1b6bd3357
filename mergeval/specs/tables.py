"""Published tables: cells exactly as printed, derived cells recomputed from them.

A table in a spec::

    chembench:
      source: where in the paper (table number, rebuttal, page)
      columns: [NC, RS, Average]
      rows:                              # one string per row: the printed cells, '-' for a blank one
        GPT-4: "55 72 63.50"
        CMM:   "63.95 72.33 68.14"
      derived:                           # a derivation per column, applied to every row that prints it;
        Average: {mean: [NC, RS]}        #   a bare name is a column of the same row
      derived_cells:                     # single cells; a reference is [row, col] or [table, row, col]
        - at: [CMM, Average]
          mean: [[CMM, NC], [CMM, RS]]
      discrepancies:                     # a derived cell that does not recompute, recorded as the paper's own
        - at: [CMM, Average]
          by: 0.12                       #   printed - recomputed, as measured
          note: why we think the paper is off
      notes: [free text]

Each derived cell is checked with ``numbers.corner_range``/``agrees``: the
printed value must be reachable from the printed inputs within their rounding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mergeval.errors import UserError
from mergeval.specs.formulas import Formula, Ref, parse_formula
from mergeval.specs.numbers import Printed, agrees, corner_range, parse_printed

_TABLE_KEYS = {"source", "columns", "rows", "derived", "derived_cells", "discrepancies", "notes"}


@dataclass
class Discrepancy:
    by: Printed  # printed - recomputed, as the spec records it
    note: str


@dataclass
class Table:
    name: str
    source: str
    columns: list[str]
    rows: list[str]
    cells: dict[tuple[str, str], Printed | None]
    derivations: list[tuple[Ref, Formula]] = field(default_factory=list)
    discrepancies: dict[tuple[str, str], Discrepancy] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CellCheck:
    """The verdict on one derived cell.

    status: "agree"; "disagree" (fails); "recorded" (disagrees as the spec's
    discrepancy record says: passes); "record-wrong" (a record that the numbers
    do not bear out: fails).
    """

    at: Ref
    kind: str
    printed: Printed
    recomputed: float  # from the printed inputs as printed
    lo: float  # the range the inputs' rounding allows
    hi: float
    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("agree", "recorded")


def parse_tables(raw: Any, field: str) -> dict[str, Table]:
    """Tables from a spec's ``tables`` mapping; references are checked once all tables are read."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise UserError(field, "must map table names to tables", "see mergeval/specs/tables.py")
    tables = {str(name): _parse_table(str(name), body, f"{field}.{name}") for name, body in raw.items()}
    for table in tables.values():
        for at, formula in table.derivations:
            for ref in [at, *formula.refs]:
                _cell(tables, ref, f"{field}.{table.name}")
    return tables


def _parse_table(name: str, body: Any, field: str) -> Table:
    if not isinstance(body, Mapping):
        raise UserError(field, "must be a mapping", f"give the keys {sorted(_TABLE_KEYS)}")
    unknown = set(body) - _TABLE_KEYS
    if unknown or not {"columns", "rows"} <= set(body):
        raise UserError(field, f"needs columns and rows; unknown keys {sorted(unknown)}",
                        f"use only {sorted(_TABLE_KEYS)}")
    columns = body["columns"]
    if not isinstance(columns, list) or not columns or len(set(map(str, columns))) != len(columns):
        raise UserError(f"{field}.columns", "needs a non-empty list of distinct column names", "list the columns")
    columns = [str(c) for c in columns]
    if not isinstance(body["rows"], Mapping) or not body["rows"]:
        raise UserError(f"{field}.rows", "needs a mapping row name -> printed cells", 'write e.g. {CMM: "1.00 2.00"}')
    cells: dict[tuple[str, str], Printed | None] = {}
    for row, printed in body["rows"].items():
        row = str(row)
        tokens = str(printed).split()
        if len(tokens) != len(columns):
            raise UserError(f"{field}.rows.{row}", f"has {len(tokens)} cells for {len(columns)} columns",
                            "give one printed value (or '-') per column, separated by spaces")
        for col, token in zip(columns, tokens):
            try:
                cells[row, col] = parse_printed(token)
            except ValueError as err:
                raise UserError(f"{field}.rows.{row}", str(err), "copy the number as printed") from None
    table = Table(name, str(body.get("source", "")), columns, [str(r) for r in body["rows"]], cells,
                  notes=[str(n) for n in body.get("notes") or []])

    derived = body.get("derived") or {}
    if not isinstance(derived, Mapping):
        raise UserError(f"{field}.derived", "must map column names to derivations", "write {Average: {mean: [..]}}")
    for col, formula in derived.items():
        col = str(col)
        if col not in columns:
            raise UserError(f"{field}.derived.{col}", "is not one of the table's columns", f"use one of {columns}")
        for row in table.rows:
            if cells[row, col] is not None:
                resolve = _resolver(name, row)
                table.derivations.append(((name, row, col), parse_formula(formula, f"{field}.derived.{col}", resolve)))
    for i, entry in enumerate(body.get("derived_cells") or []):
        where = f"{field}.derived_cells[{i}]"
        if not isinstance(entry, Mapping) or "at" not in entry:
            raise UserError(where, "needs at: [row, col] and one derivation", "write {at: [r, c], mean: [..]}")
        at = _resolver(name, None)(entry["at"], f"{where}.at")
        formula = {k: v for k, v in entry.items() if k != "at"}
        table.derivations.append((at, parse_formula(formula, where, _resolver(name, None))))
    targets = {at for at, _ in table.derivations}
    for i, entry in enumerate(body.get("discrepancies") or []):
        where = f"{field}.discrepancies[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"at", "by", "note"}:
            raise UserError(where, "needs exactly at, by and note",
                            "write {at: [row, col], by: printed - recomputed, note: why}")
        at = _resolver(name, None)(entry["at"], f"{where}.at")
        if at not in targets:
            raise UserError(f"{where}.at", f"{list(at[1:])} is not a derived cell", "record only derived cells")
        try:
            by = parse_printed(str(entry["by"]))
        except ValueError as err:
            raise UserError(f"{where}.by", str(err), "give the measured difference as a number") from None
        if by is None or not str(entry["note"]).strip():
            raise UserError(where, "by must be a number and note must say why", "fill both in")
        table.discrepancies[at[1], at[2]] = Discrepancy(by, str(entry["note"]))
    return table


def _resolver(table: str, row: str | None):
    """Turns a written reference into (table, row, col): a bare column name needs the current row."""
    def resolve(raw: Any, field: str) -> Ref:
        if isinstance(raw, str) and row is not None:
            return (table, row, raw)
        if isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, str) for x in raw):
            return (table, raw[0], raw[1])
        if isinstance(raw, list) and len(raw) == 3 and all(isinstance(x, str) for x in raw):
            return (raw[0], raw[1], raw[2])
        shapes = "a column name (in a derived column), [row, col] or [table, row, col]"
        raise UserError(field, f"{raw!r} is not a cell reference", f"write {shapes}")
    return resolve


def _cell(tables: Mapping[str, Table], ref: Ref, field: str) -> Printed:
    table, row, col = ref
    if table not in tables:
        raise UserError(field, f"refers to unknown table '{table}'", f"use one of {sorted(tables)}")
    t = tables[table]
    if (row, col) not in t.cells:
        raise UserError(field, f"refers to cell [{row}, {col}] which table '{table}' does not have",
                        f"rows: {t.rows}; columns: {t.columns}")
    printed = t.cells[row, col]
    if printed is None:
        raise UserError(field, f"refers to blank cell [{table}, {row}, {col}]", "refer to a printed cell")
    return printed


def cell(tables: Mapping[str, Table], ref: Ref, field: str = "reference") -> Printed:
    """The printed cell a reference names (UserError if there is none)."""
    return _cell(tables, ref, field)


def check_tables(tables: Mapping[str, Table]) -> list[CellCheck]:
    """Recompute every derived cell of every table from the printed inputs (see module docstring)."""
    checks = []
    for table in tables.values():
        for at, formula in table.derivations:
            inputs = [_cell(tables, ref, table.name) for ref in formula.refs]
            printed = _cell(tables, at, table.name)
            values = [p.value for p in inputs]
            try:
                recomputed = formula.fn(values)
                lo, hi = corner_range(formula.fn, values, [p.half_width for p in inputs])
            except ValueError as err:
                raise UserError(f"tables.{table.name}.{at[1]}.{at[2]}", str(err),
                                "check the derivation's inputs") from None
            if recomputed is None:
                raise UserError(f"tables.{table.name}.{at[1]}.{at[2]}", "the derivation is undefined",
                                "check the derivation's inputs")
            checks.append(_verdict(at, formula.kind, printed, recomputed, lo, hi,
                                   table.discrepancies.get((at[1], at[2]))))
    return checks


def _verdict(at: Ref, kind: str, printed: Printed, recomputed: float, lo: float, hi: float,
             record: Discrepancy | None) -> CellCheck:
    ok = agrees(printed, lo, hi)
    off = printed.value - recomputed
    if record is None:
        status = "agree" if ok else "disagree"
        detail = "" if ok else f"printed - recomputed = {off:+.4g}, beyond the inputs' rounding"
        return CellCheck(at, kind, printed, recomputed, lo, hi, status, detail)
    if ok:
        return CellCheck(at, kind, printed, recomputed, lo, hi, "record-wrong",
                         "recorded as a discrepancy, but the printed value recomputes: remove the record")
    # the recorded difference may itself be off by the rounding of everything involved
    allowed = printed.half_width + (hi - lo) / 2 + record.by.half_width
    if abs(off - record.by.value) <= allowed + 1e-9:
        return CellCheck(at, kind, printed, recomputed, lo, hi, "recorded",
                         f"the paper's own: printed - recomputed = {off:+.4g}; {record.note}")
    return CellCheck(at, kind, printed, recomputed, lo, hi, "record-wrong",
                     f"recorded by {record.by.text}, measured {off:+.4g}: correct the record")
