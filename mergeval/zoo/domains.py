"""Deterministic generators for the quickstart's domain and general-ability data.

Every item is a dict ``{"question": str, "choices": [str, ...], "answer": int}``.
The same generator produces the training text for an expert and the held-out
evaluation items of its lm-eval task; the two are disjoint by construction
(``split_items`` removes every evaluation question from the training pool), so
an expert is never scored on a question it saw.
"""

from __future__ import annotations

import random
from collections.abc import Callable

Item = dict

# Bump when a generator changes: it is part of every expert's and task's cache key.
DATA_VERSION = 1

ELEMENTS = ["H", "C", "N", "O", "S", "P", "Cl", "Na", "K", "Ca", "Mg", "Fe", "Br", "F", "Si", "Al"]


def _formula(rng: random.Random) -> tuple[str, dict[str, int]]:
    symbols = rng.sample(ELEMENTS, rng.randint(2, 4))
    counts = {s: rng.choice([1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]) for s in symbols}
    text = "".join(s + (str(n) if n > 1 else "") for s, n in counts.items())
    return text, counts


def chem_count_item(rng: random.Random) -> Item:
    """How many atoms of one element are in a molecular formula (implicit 1 included)."""
    formula, counts = _formula(rng)
    element = rng.choice(list(counts))
    answer = counts[element]
    pool = {n for n in counts.values() if n != answer} | {answer + 1, answer + 2, answer + 3, 2 * answer, max(1, answer - 1)}
    pool.discard(answer)
    distractors = rng.sample(sorted(pool), 3)
    return _mc(rng, f"How many {element} atoms are in one molecule of {formula}?",
               _atoms(answer), [_atoms(n) for n in distractors])


def _atoms(n: int) -> str:
    # A unit after the number keeps every choice from being a prefix of another
    # ("1" of "12"), which would make the shorter choice win the log-likelihood.
    return f"{n} atom" if n == 1 else f"{n} atoms"


UNIT_FACTORS = {
    ("km", "m"): 3, ("m", "cm"): 2, ("m", "mm"): 3, ("cm", "mm"): 1,
    ("kg", "g"): 3, ("g", "mg"): 3, ("mg", "ug"): 3, ("L", "mL"): 3, ("dL", "mL"): 2, ("L", "dL"): 1,
}


def unit_convert_item(rng: random.Random) -> Item:
    """Convert a whole quantity from a larger metric unit to a smaller one (x 10^k)."""
    (src, dst), power = rng.choice(sorted(UNIT_FACTORS.items()))
    value = rng.randint(2, 999)
    answer = value * 10**power
    wrong_powers = [p for p in range(0, 5) if p != power]
    distractors = [f"{value * 10**p} {dst}" for p in rng.sample(wrong_powers, 3)]
    return _mc(rng, f"Convert {value} {src} to {dst}.", f"{answer} {dst}", distractors)


def _mc(rng: random.Random, question: str, correct: str, distractors: list[str]) -> Item:
    choices = [correct, *distractors]
    rng.shuffle(choices)
    return {"question": question, "choices": choices, "answer": choices.index(correct)}


DOMAINS: dict[str, Callable[[random.Random], Item]] = {
    "chem_count": chem_count_item,
    "unit_convert": unit_convert_item,
}


def eval_items(domain: str, n: int, seed: int = 0) -> list[Item]:
    """The first ``n`` distinct held-out items of a domain (a prefix of one fixed stream)."""
    rng = random.Random(f"{domain}-eval-{seed}")
    items: list[Item] = []
    seen: set[str] = set()
    while len(items) < n:
        item = DOMAINS[domain](rng)
        if item["question"] not in seen:
            seen.add(item["question"])
            items.append(item)
    return items


def split_items(domain: str, seed: int, n_train: int, n_eval: int, train_seed: int = 0) -> tuple[list[Item], list[Item]]:
    """Draw disjoint train and held-out eval items: no training question appears among the eval items."""
    held_out = eval_items(domain, n_eval, seed)
    seen = {item["question"] for item in held_out}
    rng = random.Random(f"{domain}-train-{train_seed}")
    train: list[Item] = []
    while len(train) < n_train:
        item = DOMAINS[domain](rng)
        if item["question"] not in seen:
            train.append(item)
    return train, held_out
