"""Published tables: cells exactly as printed, derived cells recomputed from them.

A table in a spec::

    chembench:
      source: where in the paper (table number, rebuttal, page)
      columns: [NC, RS, MolInst, Average]
      decimals: 2                        # optional: the precision the paper prints (a '0' is 0.00)
      range: [0, 100]                    # optional: the bounds of every value
      formats:                           # optional, per column: decimals, range, exact
        MolInst: {decimals: 3, range: [0, 1]}
      tolerance: 0.3                     # optional: a derived cell that cannot detect an error this large
                                         #   is "not checkable" instead of "agree" (default: 10 units of
                                         #   the derived cell's last printed digit, below)
      rows:                              # one string per row: the printed cells, '-' for a blank one,
        GPT-4: "55 72 0.41 63.50"        #   a trailing '!' for an exact value ("100!")
        CMM:   "63.95 72.33 0.35 68.14"
      derived:                           # a derivation per column, applied to every row that prints it;
        Average: {mean: [NC, RS]}        #   a bare name is a column of the same row
      derived_rows:                      # a derivation per row, applied to every column that prints it;
        Mean: {mean: [GPT-4, CMM]}       #   a bare name is a row of the same column
      derived_cells:                     # single cells; a reference is a column of the at row,
                                         #   [row, col] or [table, row, col]
        - at: [CMM, Average]
          expr: "(NC + RS) / 2"
          with: {NC: [CMM, NC], RS: [CMM, RS]}
      discrepancies:                     # a derived cell that does not recompute, recorded as the paper's own
        - at: [CMM, Average]
          by: 0.12                       #   printed - recomputed, as measured
          note: why we think the paper is off
      notes: [free text]

Names of rows and columns are any strings. In a reference, a name that YAML
reads as something else (``0.50``, ``[0.4,0.7]`` unquoted) still names the row
or column written that way (``match_name``).

Each derived cell is checked on intervals (``numbers.py``): its printed
interval must meet the range its formula takes over its inputs' intervals.
Each check is labelled by the derivation that made it (``column Average``,
``row Mean``, ``cell [CMM, Average]``): a cell that a ``derived`` column and a
``derived_rows`` row both cover is checked once by each.

How wide a window may be: a check whose inputs' rounding lets the recomputed
value move by more than ``w`` cannot catch an error of ``w`` (``_verdict``).
Above the table's ``tolerance`` the cell is "not checkable", not "agree".
Without a ``tolerance`` the default is ``DEFAULT_TOLERANCE_UNITS`` (10) units
of the derived cell's own last printed digit (its declared decimals if more):
0.1 for a cell printed ``61.43``, 1 for ``61.4``. Ten units is one unit of the
next-to-last printed digit, so a cell that agrees has every printed digit but
the last confirmed by its inputs (to within one). That is scale-free (a 0-1
table and a 0-100 table are held to the same relative standard) and costs a
plain mean of inputs printed like it nothing (its window is 2 units: one from
the inputs' rounding, one from its own), while a cell fed by a ``0`` printed in
a ×100-rescaled 0-1 column (a window of 10 points for a cell printed to 0.01)
can no longer pass silently.
State ``tolerance:`` (in the table's units) where the paper's precision
justifies another bound, e.g. a ×100 rescale of a 2-decimal 0-1 column.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import yaml

from mergeval.core.errors import UserError
from mergeval.verify.formulas import Formula, Ref, parse_formula
from mergeval.verify.numbers import Interval, Printed, interval, meets, parse_printed
from mergeval.verify.yamlload import source_text

_TABLE_KEYS = {
    "source",
    "columns",
    "rows",
    "decimals",
    "range",
    "formats",
    "tolerance",
    "derived",
    "derived_rows",
    "derived_cells",
    "discrepancies",
    "notes",
}
_FORMAT_KEYS = {"decimals", "range", "exact"}
DEFAULT_TOLERANCE_UNITS = 10  # without a tolerance: units of a derived cell's last printed digit (module docstring)


@dataclass(frozen=True)
class Format:
    """What the spec states about a column's printed numbers (numbers.interval)."""

    decimals: int | None = None
    bounds: Interval | None = None
    exact: bool = False


@dataclass
class Discrepancy:
    by: Printed  # printed - recomputed, as the spec records it
    note: str


@dataclass(frozen=True)
class Derivation:
    """One derived cell: where it is, its formula, which derivation of the spec made it, and that one's key."""

    at: Ref
    formula: Formula
    origin: str  # "column Avg" (derived), "row Mean" (derived_rows), "cell [CMM, Avg]" (derived_cells)
    key: str  # the formula's key under the spec's tables: T.derived.Avg.expr


@dataclass
class Table:
    name: str
    source: str
    columns: list[str]
    rows: list[str]
    cells: dict[tuple[str, str], Printed | None]
    formats: dict[str, Format] = field(default_factory=dict)  # per column
    tolerance: float | None = None
    derivations: list[Derivation] = field(default_factory=list)
    discrepancies: dict[tuple[str, str], Discrepancy] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def printed(self, row: str, col: str) -> Printed:
        """The printed cell [row, col]. Blank cells are never read: a reference to one is refused (``find_cell``,
        derived_cells), derived columns and rows skip them, and so does ``line``."""
        printed = self.cells[row, col]
        assert printed is not None, f"cell [{row}, {col}] of table {self.name} is blank"
        return printed

    def interval(self, row: str, col: str) -> Interval:
        """The true values the printed cell [row, col] stands for, under its column's format."""
        fmt = self.formats.get(col, Format())
        printed = self.printed(row, col)
        if fmt.exact:
            printed = Printed(printed.text, printed.value, printed.decimals, True)
        return interval(printed, fmt.decimals, fmt.bounds)

    def decimals(self, row: str, col: str) -> int:
        """The precision of the printed cell: max(printed decimals, its column's declared decimals)."""
        return max(self.printed(row, col).decimals, self.formats.get(col, Format()).decimals or 0)

    def derived(self, axis: str) -> set[str]:
        """The rows (axis "rows") that ``derived_rows`` computes, or the columns ("columns") that ``derived`` does:
        summaries of the others, which quantifiers leave out (quantified.py)."""
        kind = "row " if axis == "rows" else "column "
        return {d.origin[len(kind) :] for d in self.derivations if d.origin.startswith(kind)}


@dataclass(frozen=True)
class CellCheck:
    """The verdict on one derived cell.

    status: "agree"; "disagree" (fails); "recorded" (disagrees as the spec's
    discrepancy record says: passes); "record-wrong" (a record that the numbers
    do not bear out: fails); "not checkable" (agrees, but its window is wider
    than the table's tolerance, so an error that large could pass: fails only
    with --strict). ``origin`` is the derivation that made the check
    (``column Avg``, ``row Mean``, ``cell [CMM, Avg]``).
    """

    at: Ref
    kind: str
    printed: Printed
    recomputed: float  # from the printed inputs as printed
    lo: float  # the range the inputs' rounding allows
    hi: float
    status: str
    detail: str = ""
    origin: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("agree", "recorded")

    @property
    def failed(self) -> bool:
        return self.status in ("disagree", "record-wrong")


# ---------------------------------------------------------------- names


def name_text(raw: Any) -> str | None:
    """A written name as text: a string as is, a number or flow list as it was written, else None."""
    if isinstance(raw, str):
        return raw
    return source_text(raw)


def _yaml_value(name: str) -> Any:
    try:
        return yaml.safe_load(name)
    except yaml.YAMLError:
        return None


def match_name(names: Sequence[str], raw: Any) -> str | None:
    """The one name in ``names`` that ``raw`` denotes, or None.

    ``raw`` denotes a name when its text is the name, or when YAML reads the
    name as the same value as ``raw`` (so ``[0.4, 0.7]`` names ``[0.4,0.7]``).
    """
    text = name_text(raw)
    if text in names:
        return text
    same = [n for n in names if _same_value(_yaml_value(n), raw)]
    return same[0] if len(same) == 1 else None


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return isinstance(a, list) and isinstance(b, list) and a == b


def show(name: str) -> str:
    """A name for a one-line message."""
    return repr(name) if name != name.strip() or not name else name


# ---------------------------------------------------------------- parsing


def parse_tables(raw: Any, field: str) -> dict[str, Table]:
    """Tables from a spec's ``tables`` mapping; references are checked once all tables are read."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise UserError(field, "must map table names to tables", "see docs/specs.md")
    tables = {str(name): _parse_table(str(name), body, f"{field}.{name}") for name, body in raw.items()}
    for table in tables.values():  # every reference checked (other tables, blank cells), as the names it matched
        table.derivations = [
            replace(
                d,
                formula=replace(d.formula, refs=[find_cell(tables, r, f"{field}.{d.key}")[0] for r in d.formula.refs]),
            )
            for d in table.derivations
        ]
    return tables


def _format(raw: Any, field: str, base: Format = Format()) -> Format:
    """A Format from {decimals, range, exact}, unset keys taken from ``base``."""
    if not isinstance(raw, Mapping) or set(raw) - _FORMAT_KEYS:
        raise UserError(
            field,
            f"must be a mapping with keys among {sorted(_FORMAT_KEYS)}",
            "write e.g. {decimals: 2, range: [0, 1]}",
        )
    decimals, bounds, exact = (
        raw.get("decimals", base.decimals),
        raw.get("range", base.bounds),
        raw.get("exact", base.exact),
    )
    if decimals is not None and not (isinstance(decimals, int) and not isinstance(decimals, bool) and decimals >= 0):
        raise UserError(f"{field}.decimals", f"must be a whole number >= 0, got {decimals!r}", "write decimals: 2")
    if bounds is not None:
        numbers = (
            isinstance(bounds, Sequence)
            and len(bounds) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in bounds)
        )
        if not numbers or bounds[0] >= bounds[1]:
            raise UserError(
                f"{field}.range", f"must be [low, high] with low < high, got {bounds!r}", "write range: [0, 100]"
            )
        bounds = (float(bounds[0]), float(bounds[1]))
    if not isinstance(exact, bool):
        raise UserError(f"{field}.exact", f"must be true or false, got {exact!r}", "write exact: true")
    return Format(decimals, bounds, exact)


def _names(raw: Any, field: str, what: str) -> list[str]:
    names = [_text(n) for n in raw] if isinstance(raw, list) else []
    if not names:
        raise UserError(field, f"needs a non-empty list of distinct {what} names", f"list the {what}s")
    twice = [n for i, n in enumerate(names) if n in names[:i]]
    if twice:
        raise UserError(field, f"lists {what} {show(twice[0])} twice", f"give each {what} once, with its own name")
    return names


def _parse_table(name: str, body: Any, field: str) -> Table:
    if not isinstance(body, Mapping):
        raise UserError(field, "must be a mapping", f"give the keys {sorted(_TABLE_KEYS)}")
    unknown = set(body) - _TABLE_KEYS
    if unknown or not {"columns", "rows"} <= set(body):
        raise UserError(
            field, f"needs columns and rows; unknown keys {sorted(unknown)}", f"use only {sorted(_TABLE_KEYS)}"
        )
    columns = _names(body["columns"], f"{field}.columns", "column")
    if not isinstance(body["rows"], Mapping) or not body["rows"]:
        raise UserError(f"{field}.rows", "needs a mapping row name -> printed cells", 'write e.g. {CMM: "1.00 2.00"}')
    default = _format({k: body[k] for k in ("decimals", "range") if k in body}, field)
    formats = dict.fromkeys(columns, default)
    for col, raw in (body.get("formats") or {}).items():
        known = match_name(columns, col)
        if known is None:
            raise UserError(f"{field}.formats.{col}", "is not one of the table's columns", f"use one of {columns}")
        formats[known] = _format(raw, f"{field}.formats.{col}", default)
    tolerance = body.get("tolerance")
    if tolerance is not None and not (
        isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool) and tolerance > 0
    ):
        raise UserError(f"{field}.tolerance", f"must be a number > 0, got {tolerance!r}", "write tolerance: 0.3")
    cells: dict[tuple[str, str], Printed | None] = {}
    rows = [str(r) for r in body["rows"]]
    for row, printed in body["rows"].items():
        tokens = str(printed).split()
        if len(tokens) != len(columns):
            raise UserError(
                f"{field}.rows.{row}",
                f"has {len(tokens)} cells for {len(columns)} columns",
                "give one printed value (or '-') per column, separated by spaces",
            )
        for col, token in zip(columns, tokens):
            try:
                cells[row, col] = parse_printed(token)
            except ValueError as err:
                raise UserError(f"{field}.rows.{row}", str(err), "copy the number as printed") from None
    table = Table(
        name,
        str(body.get("source", "")),
        columns,
        rows,
        cells,
        formats,
        float(tolerance) if tolerance is not None else None,
        notes=[str(n) for n in body.get("notes") or []],
    )
    for row, col in cells:
        if cells[row, col] is not None:
            try:
                table.interval(row, col)
            except ValueError as err:
                raise UserError(f"{field}.rows.{row}", f"column {col}: {err}", "fix the cell or the range") from None
    _parse_derived(table, body, field)
    return table


def _parse_derived(table: Table, body: Mapping, field: str) -> None:
    """derived (per column), derived_rows (per row), derived_cells, discrepancies: into ``table``."""
    name = table.name
    for key, axis, others in (("derived", table.columns, table.rows), ("derived_rows", table.rows, table.columns)):
        derived = body.get(key) or {}
        if not isinstance(derived, Mapping):
            raise UserError(f"{field}.{key}", "must map names to derivations", f"write {{{axis[0]}: {{mean: [..]}}}}")
        for target, formula in derived.items():
            known = match_name(axis, target)
            if known is None:
                raise UserError(
                    f"{field}.{key}.{target}",
                    f"is not one of the table's {'columns' if key == 'derived' else 'rows'}",
                    f"use one of {axis}",
                )
            for other in others:
                row, col = (other, known) if key == "derived" else (known, other)
                if table.cells[row, col] is not None:
                    resolve = _resolver(
                        table, row=row if key == "derived" else None, col=col if key == "derived_rows" else None
                    )
                    parsed = parse_formula(formula, f"{field}.{key}.{target}", resolve)
                    origin = f"{'column' if key == 'derived' else 'row'} {known}"
                    table.derivations.append(
                        Derivation((name, row, col), parsed, origin, f"{name}.{key}.{target}.{parsed.kind}")
                    )
    for i, entry in enumerate(body.get("derived_cells") or []):
        where = f"{field}.derived_cells[{i}]"
        if not isinstance(entry, Mapping) or "at" not in entry:
            raise UserError(where, "needs at: [row, col] and one derivation", "write {at: [r, c], mean: [..]}")
        at = _resolver(table)(entry["at"], f"{where}.at")
        if (at[1], at[2]) in table.cells and table.cells[at[1], at[2]] is None:
            raise UserError(f"{where}.at", f"[{at[1]}, {at[2]}] is a blank cell", "derive a printed cell")
        formula = {k: v for k, v in entry.items() if k != "at"}
        # a bare name is a column of the cell's own row, as in ``derived``
        parsed = parse_formula(formula, where, _resolver(table, row=at[1]))
        table.derivations.append(
            Derivation(at, parsed, f"cell [{at[1]}, {at[2]}]", f"{name}.derived_cells[{i}].{parsed.kind}")
        )
    targets = {d.at for d in table.derivations}
    for i, entry in enumerate(body.get("discrepancies") or []):
        where = f"{field}.discrepancies[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"at", "by", "note"}:
            raise UserError(
                where, "needs exactly at, by and note", "write {at: [row, col], by: printed - recomputed, note: why}"
            )
        at = _resolver(table)(entry["at"], f"{where}.at")
        if at not in targets:
            raise UserError(f"{where}.at", f"{list(at[1:])} is not a derived cell", "record only derived cells")
        try:
            by = parse_printed(str(name_text(entry["by"]) or entry["by"]))
        except ValueError as err:
            raise UserError(f"{where}.by", str(err), "give the measured difference as a number") from None
        if by is None or not str(entry["note"]).strip():
            raise UserError(where, "by must be a number and note must say why", "fill both in")
        table.discrepancies[at[1], at[2]] = Discrepancy(by, str(entry["note"]))


def _resolver(table: Table, row: str | None = None, col: str | None = None):
    """Turns a written reference into (table, row, col).

    A bare name is a column of ``row`` (in ``derived``) or a row of ``col`` (in
    ``derived_rows``); ``[row, col]`` is a cell of this table; ``[table, row,
    col]`` a cell of any table (its names are matched when all tables are read).
    A name this table lacks is a UserError at ``field`` (the formula's key).
    """

    def known(names: list[str], raw: Any, what: str, field: str) -> str:
        name = match_name(names, raw)
        if name is None:
            raise UserError(
                field,
                f"refers to {what} {show(_text(raw))}, which table '{table.name}' does not have",
                f"use one of {names} (quote a name YAML would read as a number or list; "
                "in an expr, backquote a name that is not an identifier)",
            )
        return name

    def resolve(raw: Any, field: str) -> Ref:
        if not isinstance(raw, list):
            if row is not None:
                return (table.name, row, known(table.columns, raw, "column", field))
            if col is not None:
                return (table.name, known(table.rows, raw, "row", field), col)
        elif len(raw) == 2:
            return (table.name, known(table.rows, raw[0], "row", field), known(table.columns, raw[1], "column", field))
        elif len(raw) == 3 and isinstance(raw[0], str):
            return (raw[0], raw[1], raw[2])  # names matched against that table in ``cell``
        shapes = "a column name (in derived), a row name (in derived_rows), [row, col] or [table, row, col]"
        raise UserError(field, f"{raw!r} is not a cell reference", f"write {shapes}")

    return resolve


def _text(raw: Any) -> str:
    text = name_text(raw)
    return text if text is not None else str(raw)


def find_cell(tables: Mapping[str, Table], ref: Sequence[Any], field: str) -> tuple[Ref, Printed]:
    """The (table, row, col) a written reference names, with its printed cell; UserError if there is none."""
    table, row, col = ref
    if table not in tables:
        raise UserError(field, f"refers to unknown table '{table}'", f"use one of {sorted(tables)}")
    t = tables[table]
    r, c = match_name(t.rows, row), match_name(t.columns, col)
    if r is None or c is None:
        bad = f"row {show(_text(row))}" if r is None else f"column {show(_text(col))}"
        raise UserError(
            field,
            f"refers to {bad}, which table '{table}' does not have",
            f"rows: {t.rows}; columns: {t.columns} (quote a name YAML would read as a number or list)",
        )
    printed = t.cells[r, c]
    if printed is None:
        raise UserError(field, f"refers to blank cell [{table}, {r}, {c}]", "refer to a printed cell")
    return (table, r, c), printed


def cell(tables: Mapping[str, Table], ref: Sequence[Any], field: str = "reference") -> Printed:
    """The printed cell a reference names (UserError if there is none)."""
    return find_cell(tables, ref, field)[1]


def cell_interval(tables: Mapping[str, Table], ref: Sequence[Any], field: str = "reference") -> Interval:
    """The true values the cell a reference names stands for (its table's formats applied)."""
    (table, row, col), _ = find_cell(tables, ref, field)
    return tables[table].interval(row, col)


def line(
    table: Table, col: str | None = None, row: str | None = None, without: Sequence[str] = ()
) -> list[tuple[str, Printed, Interval]]:
    """The printed cells of one column (over its rows) or one row (over its columns), minus ``without``,
    blanks skipped: (name, printed, interval) in table order."""
    if col is not None:
        return [
            (r, table.printed(r, col), table.interval(r, col))
            for r in table.rows
            if r not in without and table.cells[r, col] is not None
        ]
    assert row is not None, "a line is a column or a row"
    return [
        (c, table.printed(row, c), table.interval(row, c))
        for c in table.columns
        if c not in without and table.cells[row, c] is not None
    ]


# ---------------------------------------------------------------- checking


def check_tables(tables: Mapping[str, Table], field: str = "tables") -> list[CellCheck]:
    """Recompute every derived cell of every table from the printed inputs (see module docstring).

    UserError naming the formula's key (``field``.table.derived.col.kind) and the cell where a derivation is
    undefined on its inputs' intervals.
    """
    checks = []
    for table in tables.values():
        for d in table.derivations:
            where = f"{field}.{d.key}"  # the formula's key
            inputs = [find_cell(tables, ref, where) for ref in d.formula.refs]
            values = [p.value for _, p in inputs]
            try:  # the range first: where the printed values are themselves a pole, it says how far it reaches
                lo, hi = d.formula.range([tables[r[0]].interval(r[1], r[2]) for r, _ in inputs])
                recomputed = d.formula.fn(values)
            except ValueError as err:
                raise UserError(where, f"at [{d.at[1]}, {d.at[2]}]: {err}", "check the derivation's inputs") from None
            if recomputed is None:
                raise UserError(
                    where, f"at [{d.at[1]}, {d.at[2]}]: the derivation is undefined", "check the derivation's inputs"
                )
            checks.append(_verdict(d, table, recomputed, lo, hi))
    return checks


def tolerance(table: Table, row: str, col: str) -> tuple[float, str]:
    """The largest window a derived cell [row, col] may have and still "agree", and where that bound comes from:
    the table's ``tolerance``, else DEFAULT_TOLERANCE_UNITS units of the cell's last printed digit."""
    if table.tolerance is not None:
        return table.tolerance, f"the tolerance {table.tolerance:g}"
    d = table.decimals(row, col)
    bound = DEFAULT_TOLERANCE_UNITS * 10.0**-d
    return bound, f"the default tolerance {bound:g} ({DEFAULT_TOLERANCE_UNITS} units of its last printed digit)"


def _verdict(derivation: Derivation, table: Table, recomputed: float, lo: float, hi: float) -> CellCheck:
    """agree / disagree / not checkable, or recorded / record-wrong where the spec records a discrepancy.

    The printed interval P = [p_lo, p_hi] agrees when it meets [lo, hi]. Any
    printed value farther than  w = (hi - lo) + (p_hi - p_lo)  from one that
    agrees disagrees, so w is the smallest error the check is sure to catch:
    above the table's tolerance (``tolerance``) the cell is "not checkable".
    """
    at, kind = derivation.at, derivation.formula.text
    check = partial(CellCheck, at, kind, origin=derivation.origin)
    printed = table.printed(at[1], at[2])
    p_lo, p_hi = table.interval(at[1], at[2])
    ok = meets((p_lo, p_hi), (lo, hi))
    off = printed.value - recomputed
    record = table.discrepancies.get((at[1], at[2]))
    if record is None:
        window = (hi - lo) + (p_hi - p_lo)
        if not ok:
            return check(
                printed,
                recomputed,
                lo,
                hi,
                "disagree",
                f"printed - recomputed = {off:+.4g}, beyond the inputs' rounding",
            )
        bound, source = tolerance(table, at[1], at[2])
        if window > bound * (1 + 1e-9) + 1e-12:
            return check(
                printed,
                recomputed,
                lo,
                hi,
                "not checkable",
                f"rounding lets it move by {window:.3g}, more than {source}; declare decimals/range, "
                "mark exact inputs with '!', or state the table's tolerance where the paper's precision "
                "allows no better",
            )
        return check(printed, recomputed, lo, hi, "agree")
    if ok:
        return check(
            printed,
            recomputed,
            lo,
            hi,
            "record-wrong",
            "recorded as a discrepancy, but the printed value recomputes: remove the record",
        )
    # the recorded difference may itself be off by the rounding of everything involved
    allowed = (p_hi - p_lo) / 2 + (hi - lo) / 2 + record.by.half_width
    if abs(off - record.by.value) <= allowed + 1e-9:
        return check(
            printed,
            recomputed,
            lo,
            hi,
            "recorded",
            f"the paper's own: printed - recomputed = {off:+.4g}; {record.note}",
        )
    return check(
        printed,
        recomputed,
        lo,
        hi,
        "record-wrong",
        f"recorded by {record.by.text}, measured {off:+.4g}: correct the record",
    )
