"""Printed numbers and how far their rounding lets a derived number move.

Pure functions, no I/O.

A number printed with d decimals (``61.43``, ``55``, ``+21.83``) stands for any
true value in ``[v - h, v + h]`` with ``h = 0.5 * 10**-d`` (``61.43`` is known
to +-0.005, ``55`` to +-0.5). A derived number f(x_1..x_n) recomputed from
printed inputs can therefore lie anywhere in

    [lo, hi] = [min f, max f] over the box  prod_i [x_i - h_i, x_i + h_i]

and the printed derived value ``p`` (itself +-h_p) *agrees* when its rounding
interval meets that range:  ``p + h_p >= lo  and  p - h_p <= hi``, i.e. some
true inputs consistent with the printed ones give a value that prints as p.

``corner_range`` finds [lo, hi] by evaluating f at the 2^n corners of the
box. That is exact for every f that is monotone in each input when the others
are held fixed (the direction may depend on them): group means (linear, so the
half-width is sum_i |df/dx_i| h_i, and an input rescaled by s carries s * h_i),
Macro-Gain, Macro-OG (a max of means) and the normalized score away from a
zero denominator. Those are the derivations specs use.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_CORNER_INPUTS = 16  # 2^16 evaluations of a small pure function: well under a second
_NUMBER = re.compile(r"[+-]?\d+(?:\.(\d+))?")


@dataclass(frozen=True)
class Printed:
    """A number as a paper prints it: its value and its number of decimals."""

    text: str
    value: float
    decimals: int

    @property
    def half_width(self) -> float:
        """h = 0.5 * 10^-decimals: how far the unrounded value may be from the printed one."""
        return 0.5 * 10.0 ** -self.decimals


def parse_printed(token: str) -> Printed | None:
    """``'-'`` (a blank cell) -> None; ``'46.00'`` -> Printed(46.0, 2 decimals).

    Accepts an optional sign (``+`` or ``-``, also the typographic minus
    ``\u2212``) and digits with an optional decimal part; raises ValueError otherwise.
    """
    text = token.strip()
    if text == "-":
        return None
    normal = text.replace("\u2212", "-")
    match = _NUMBER.fullmatch(normal)
    if match is None:
        raise ValueError(f"{token!r} is not a printed number (digits with an optional sign and decimals, or '-')")
    return Printed(text, float(normal), len(match.group(1) or ""))


def corner_range(f: Callable[[Sequence[float]], float], values: Sequence[float],
                 half_widths: Sequence[float]) -> tuple[float, float]:
    """(min, max) of f over the corners of the box  prod_i [values_i - h_i, values_i + h_i].

    Inputs with h_i = 0 are exact and stay fixed. Exact for f monotone in each
    input separately (see the module docstring). Raises ValueError for
    mismatched lengths, a negative or non-finite h_i, more than
    MAX_CORNER_INPUTS uncertain inputs, or f returning a non-finite value.
    """
    if len(values) != len(half_widths):
        raise ValueError(f"{len(values)} values but {len(half_widths)} half-widths")
    if any(not (math.isfinite(h) and h >= 0) for h in half_widths):
        raise ValueError(f"half-widths must be finite and >= 0, got {list(half_widths)}")
    free = [i for i, h in enumerate(half_widths) if h > 0]
    if len(free) > MAX_CORNER_INPUTS:
        raise ValueError(f"{len(free)} rounded inputs: at most {MAX_CORNER_INPUTS} are supported")
    lo, hi = math.inf, -math.inf
    point = list(values)
    for signs in itertools.product((-1.0, 1.0), repeat=len(free)):
        for i, s in zip(free, signs):
            point[i] = values[i] + s * half_widths[i]
        y = f(point)
        if y is None or not math.isfinite(y):
            raise ValueError(f"the derivation is undefined at inputs {point} (within the inputs' rounding)")
        lo, hi = min(lo, y), max(hi, y)
    return lo, hi


def agrees(printed: Printed, lo: float, hi: float) -> bool:
    """Whether the printed value's rounding interval meets [lo, hi].

        p + h_p >= lo  and  p - h_p <= hi

    with a relative slack of 1e-9 for float rounding in the recomputation.
    """
    slack = 1e-9 * max(1.0, abs(printed.value), abs(lo), abs(hi))
    h = printed.half_width
    return printed.value + h >= lo - slack and printed.value - h <= hi + slack
