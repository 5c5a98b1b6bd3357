"""Printed numbers, the intervals they stand for, and how far rounding lets a derived number move.

Pure functions, no I/O.

A number printed with d decimals (``61.43``, ``55``, ``+21.83``) stands for any
true value in ``[v - h, v + h]`` with ``h = 0.5 * 10**-d`` (``61.43`` is known
to +-0.005, ``55`` to +-0.5). Three things a spec can state narrow that
interval (``interval``):

- the column's precision: with ``decimals: 2`` a cell printed ``0`` is taken
  as ``0.00`` (+-0.005, not +-0.5): the paper dropped trailing zeros, not
  precision. The precision used is max(printed decimals, declared decimals);
- the column's bounds: with ``range: [0, 1]`` the interval is clipped to it
  (``0.00`` is [0, 0.005], never a negative accuracy);
- exactness: a cell written ``100!`` is exactly 100 (a count, a definition).

A derived number f(x_1..x_n) recomputed from printed inputs can lie anywhere in

    [lo, hi] = [min f, max f] over the box  prod_i [lo_i, hi_i]

and the printed derived value *agrees* when its own interval meets that range
(some true inputs consistent with the printed ones give a value that prints as
printed). ``corner_range`` finds [lo, hi] by evaluating f at the 2^n corners
of the box: exact for every f monotone in each input when the others are held
fixed (group means, Macro-Gain, Macro-OG, normalized scores away from a zero
denominator). Plain formulas use interval arithmetic instead (``expr.py``).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_CORNER_INPUTS = 16  # 2^16 evaluations of a small pure function: well under a second
_NUMBER = re.compile(r"[+-]?\d+(?:\.(\d+))?")
EXACT_MARK = "!"

Interval = tuple[float, float]


@dataclass(frozen=True)
class Printed:
    """A number as a paper prints it: its text, value, decimals, and whether the spec marks it exact."""

    text: str
    value: float
    decimals: int
    exact: bool = False

    @property
    def half_width(self) -> float:
        """h = 0.5 * 10^-decimals (0 when exact): how far the unrounded value may be from the printed one."""
        return 0.0 if self.exact else 0.5 * 10.0**-self.decimals


def parse_printed(token: str) -> Printed | None:
    """``'-'`` (a blank cell) -> None; ``'46.00'`` -> Printed(46.0, 2 decimals); ``'100!'`` -> exactly 100.

    Accepts an optional sign (``+`` or ``-``, also the typographic minus
    ``\u2212``), digits with an optional decimal part, and an optional trailing
    ``!`` (exact); raises ValueError otherwise.
    """
    text = token.strip()
    if text == "-":
        return None
    exact = text.endswith(EXACT_MARK)
    number = text[:-1] if exact else text
    normal = number.replace("\u2212", "-")
    match = _NUMBER.fullmatch(normal)
    if match is None:
        raise ValueError(
            f"{token!r} is not a printed number (digits with an optional sign and decimals, "
            f"'{EXACT_MARK}' after it for an exact value, or '-')"
        )
    return Printed(number, float(normal), len(match.group(1) or ""), exact)


def interval(printed: Printed, decimals: int | None = None, bounds: Interval | None = None) -> Interval:
    """The true values a printed number stands for (module docstring).

        h = 0 if exact else 0.5 * 10^-max(printed decimals, decimals)
        [v - h, v + h]  intersected with  bounds

    Raises ValueError when the printed value lies outside the bounds.
    """
    h = 0.0 if printed.exact else 0.5 * 10.0 ** -max(printed.decimals, decimals or 0)
    lo, hi = printed.value - h, printed.value + h
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
        if lo > hi:
            raise ValueError(f"{printed.text} is outside the range [{bounds[0]:g}, {bounds[1]:g}]")
    return lo, hi


def corner_range(f: Callable[[Sequence[float]], float | None], boxes: Sequence[Interval]) -> Interval:
    """(min, max) of f over the corners of the box  prod_i [lo_i, hi_i].

    Inputs with lo_i = hi_i are exact and stay fixed. Exact for f monotone in
    each input separately (see the module docstring). Raises ValueError for an
    empty or non-finite interval, more than MAX_CORNER_INPUTS uncertain inputs,
    or f undefined (None or non-finite) at a corner.
    """
    if any(not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi) for lo, hi in boxes):
        raise ValueError(f"intervals must be finite with lo <= hi, got {list(boxes)}")
    free = [i for i, (lo, hi) in enumerate(boxes) if hi > lo]
    if len(free) > MAX_CORNER_INPUTS:
        raise ValueError(
            f"{len(free)} rounded inputs: at most {MAX_CORNER_INPUTS} are supported "
            "(mark exact inputs with '!' or write the derivation as an expr)"
        )
    lo, hi = math.inf, -math.inf
    point = [b[0] for b in boxes]
    for ends in itertools.product((0, 1), repeat=len(free)):
        for i, end in zip(free, ends):
            point[i] = boxes[i][end]
        y = f(point)
        if y is None or not math.isfinite(y):
            raise ValueError(f"the derivation is undefined at inputs {point} (within the inputs' rounding)")
        lo, hi = min(lo, y), max(hi, y)
    return lo, hi


def show_interval(lo: float, hi: float, signed: bool = False, digits: int = 6) -> str:
    """``[lo, hi]`` with enough significant digits (``digits`` at least, up to 15) that each printed end is within
    1% of the width of the true one, float noise dropped: ``[-0.0005, 0.0005]``, ``[12345.675, 12345.685]``
    (not ``[12345.7, 12345.7]``)."""
    sign, close = "+" if signed else "", 0.01 * (hi - lo)
    for shown in range(digits, 16):
        a, b = f"{lo:{sign}.{shown}g}", f"{hi:{sign}.{shown}g}"
        if abs(float(a) - lo) <= close and abs(float(b) - hi) <= close:
            break
    return f"[{a}, {b}]"


def _slack(*xs: float) -> float:
    """Float rounding in a recomputation: 1e-9 relative to the largest magnitude involved."""
    return 1e-9 * max(1.0, *(abs(x) for x in xs))


def meets(a: Interval, b: Interval) -> bool:
    """Whether two intervals share a point:  a_lo <= b_hi  and  b_lo <= a_hi  (with float slack)."""
    slack = _slack(*a, *b)
    return a[0] <= b[1] + slack and b[0] <= a[1] + slack
