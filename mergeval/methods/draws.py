"""The random draws of the merge methods: a counter-based generator keyed by (seed, tensor, expert, entry).

Every uniform a method draws is a pure function of where it is used, not of what was drawn before it, so a
tensor's masks are the same whatever the device, the row blocks or the threads that compute them:

    key      = (k0, k1): bytes 0-3 and 4-7, each read as a little-endian uint32, of
               sha256("<seed>:<tensor name>:<stream>") with <stream> the expert's index in decimal (a pipeline
               stage's draws: "<stage>.<expert>", ``Draws.stream``); the name is the engine's unit key
    counter  = (c0, c1) = (i mod 2^32, floor(i / 2^32)), i the entry's flat row-major index in the whole tensor
    u        = (x0 >> 8) * 2^-24, (x0, x1) = Threefry-2x32-20(key, counter)    one float32 in [0, 1) per entry

Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
generator of Random123 and JAX), on 32-bit words with wrapping addition:

    ks = (k0, k1, 0x1BD11BDA ^ k0 ^ k1)
    x0 = c0 + ks[0];  x1 = c1 + ks[1]
    for r in 0..19:   x0 = x0 + x1;  x1 = rotl(x1, R[r mod 8]) ^ x0      R = (13, 15, 26, 6, 17, 29, 16, 24)
                      after round r = 4s - 1 (s = 1..5): x0 = x0 + ks[s mod 3];  x1 = x1 + ks[(s + 1) mod 3] + s

u takes x0's top 24 bits, so it is exact in float32 and ``u < p`` compares in float32 as the methods do (a
Python float p is rounded to float32 first: torch compares a float32 tensor with a scalar in float32).
``keep(..., density)`` is ``u < density`` computed on the integers: (x0 >> 8) < ceil(float32(density) * 2^24).

The torch functions here (``threefry2x32``, ``uniform``, ``keep``; int64 tensors holding 32-bit words, so any
torch device computes the same bits) are the definition; ``Draws`` hands a method its tensor's draws by them.
The engine hands the methods ``fused.CompiledDraws``, which computes the same bits through numba kernels for
large draws on the CPU (tests/methods/test_draws.py holds them to this definition).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)  # Threefry-2x32's rotation constants, round r uses R[r mod 8]
PARITY = 0x1BD11BDA  # the key schedule's parity constant (the third key word is it xor k0 xor k1)
ROUNDS = 20
MASK = 0xFFFFFFFF
# entries per step of the torch definition: its int64 temporaries (four of them) stay a few MiB on the CPU;
# a device takes larger steps (each step is some 150 kernel launches)
CHUNK_CPU, CHUNK_DEVICE = 1 << 16, 1 << 22


def key_of(seed: int, name: str, stream: str) -> tuple[int, int]:
    """(k0, k1) of the draws for ``stream`` (an expert's index, or "<stage>.<expert>") of tensor ``name``."""
    digest = hashlib.sha256(f"{seed}:{name}:{stream}".encode()).digest()
    return int.from_bytes(digest[0:4], "little"), int.from_bytes(digest[4:8], "little")


def threefry2x32(key: tuple[int, int], c0: torch.Tensor, c1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32-20 of the counters (c0, c1) under ``key`` (the module's docstring): int64 tensors holding
    32-bit words in (left as they are), the two output words out (int64, in [0, 2^32)).

    In place on two int64 tensors: x1 is masked to 32 bits after every step that can carry beyond them, since
    its rotation reads its top bits; x0 is masked only at the end, since only its low 32 bits ever reach x1
    (through the xor, masked after it), a sum or the output (it stays below 2^38: 25 additions of words)."""
    k0, k1 = key
    ks = (k0, k1, PARITY ^ k0 ^ k1)
    x0 = c0 + ks[0]
    x1 = (c1 + ks[1]).bitwise_and_(MASK)
    high = torch.empty_like(x1)
    for r in range(ROUNDS):
        rot = ROTATIONS[r % 8]
        x0 += x1
        torch.bitwise_right_shift(x1, 32 - rot, out=high)
        x1.bitwise_left_shift_(rot).bitwise_or_(high).bitwise_xor_(x0).bitwise_and_(MASK)  # rotl(x1, rot) ^ x0
        if r % 4 == 3:  # key injection s
            s = (r + 1) // 4
            x0 += ks[s % 3]
            x1.add_(ks[(s + 1) % 3] + s).bitwise_and_(MASK)
    return x0.bitwise_and_(MASK), x1


def _first_words(key: tuple[int, int], start: int, n: int, device: torch.device) -> torch.Tensor:
    """x0 of the counters start .. start + n - 1 (int64), by ``threefry2x32``."""
    index = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return threefry2x32(key, index & MASK, index >> 32)[0]


def _chunks(n: int, device: torch.device):
    step = CHUNK_CPU if device.type == "cpu" else CHUNK_DEVICE
    return ((lo, min(n, lo + step)) for lo in range(0, n, step))


def uniform(key: tuple[int, int], start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """u of the entries start .. start + n - 1 (float32, on ``device``): the definition."""
    device = torch.device(device)
    out = torch.empty(n, dtype=torch.float32, device=device)
    for lo, hi in _chunks(n, device):
        out[lo:hi] = (_first_words(key, start + lo, hi - lo, device) >> 8).to(torch.float32).mul_(2.0**-24)
    return out


def keep_threshold(density: float) -> int:
    """T with [u < density] = [x0 >> 8 < T], u = (x0 >> 8) * 2^-24 compared in float32: m * 2^-24 < d32 <=>
    m < d32 * 2^24 (exact in float64) <=> m < ceil(d32 * 2^24), d32 the density rounded to float32."""
    return math.ceil(float(np.float32(density)) * 2.0**24)


def keep(key: tuple[int, int], start: int, n: int, density: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[u < density] of the entries start .. start + n - 1 (bool, on ``device``): the definition, without the
    float tensor."""
    device = torch.device(device)
    threshold = keep_threshold(density)
    out = torch.empty(n, dtype=torch.bool, device=device)
    for lo, hi in _chunks(n, device):
        out[lo:hi] = (_first_words(key, start + lo, hi - lo, device) >> 8) < threshold
    return out


class Draws:
    """One tensor's draws (a merge unit's: the engine makes one per unit from the run's seed and the unit's key),
    handed to a method as its ``gen``. Expert i draws from its own stream: entry j of the whole tensor has the
    same u whichever block, device or thread asks for it, and whatever was drawn before.

    ``uniform`` and ``keep`` take the shape of the entries drawn and, for a row block, the flat index of its
    first entry in the whole tensor (``start``), and compute on ``device`` (the torch definition)."""

    def __init__(self, seed: int, name: str, stream: tuple[int, ...] = ()):
        self.seed, self.name, self.path = seed, name, stream

    def __repr__(self) -> str:
        return f"Draws({self.seed!r}, {self.name!r}{f', {self.path!r}' if self.path else ''})"

    def stream(self, index: int) -> Draws:
        """Independent draws for a part of the method (a pipeline's stage ``index``): its expert i's key is
        derived from "<index>.<i>" instead of "<i>"."""
        return type(self)(self.seed, self.name, (*self.path, index))

    def key(self, expert: int) -> tuple[int, int]:
        return key_of(self.seed, self.name, ".".join(str(x) for x in (*self.path, expert)))

    def uniform(
        self, expert: int, shape: torch.Size | tuple[int, ...], start: int = 0, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """u of expert ``expert``'s entries start .. start + prod(shape) - 1, float32 of ``shape`` on ``device``."""
        return uniform(self.key(expert), start, math.prod(shape), device).view(shape)

    def keep(
        self,
        expert: int,
        shape: torch.Size | tuple[int, ...],
        density: float,
        start: int = 0,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """[u < density] of expert ``expert``'s entries start .. start + prod(shape) - 1, bool of ``shape``."""
        return keep(self.key(expert), start, math.prod(shape), density, device).view(shape)
