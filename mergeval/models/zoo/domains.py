"""Deterministic generators for the experts' domain data.

Five domains, chosen so that their task vectors interfere to different degrees
when merged (the mini reproductions of the papers need method differences to show):

- ``chem_count`` and ``time_convert`` both count or multiply into "N <unit>"
  answers to "How many ... are in ...?" questions (mild competition);
- ``unit_convert`` (multiply by 10^k) and ``unit_reduce`` (divide by 10^k) ask
  the same "Convert X a to b." question in opposite directions: their skills
  compete head-on;
- ``acronym`` is lexical (the first letters of words) and shares no answer
  format with the others.

Every item is a dict ``{"question": str, "choices": [str, ...], "answer": int}``.
The same generator produces the training text for an expert and the held-out
evaluation items of its lm-eval task; the two are disjoint by construction
(``split_items`` removes every evaluation question from the training pool), so
an expert is never scored on a question it saw.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from decimal import Decimal

Item = dict

# Bump a domain's entry when its generator changes: it is part of that domain's experts' cache key (the
# evaluation tasks are keyed by their items). Versions are per domain so that adding a domain never
# invalidates the experts already built for the others. DATA_VERSION is the version of the original two.
DATA_VERSION = 1
DOMAIN_VERSION = {
    "chem_count": DATA_VERSION,
    "unit_convert": DATA_VERSION,
    "unit_reduce": 1,
    "time_convert": 1,
    "acronym": 1,
}

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
    pool = {n for n in counts.values() if n != answer} | {
        answer + 1,
        answer + 2,
        answer + 3,
        2 * answer,
        max(1, answer - 1),
    }
    pool.discard(answer)
    distractors = rng.sample(sorted(pool), 3)
    return _mc(
        rng,
        f"How many {element} atoms are in one molecule of {formula}?",
        _atoms(answer),
        [_atoms(n) for n in distractors],
    )


def _atoms(n: int) -> str:
    # A unit after the number keeps every choice from being a prefix of another
    # ("1" of "12"), which would make the shorter choice win the log-likelihood.
    return f"{n} atom" if n == 1 else f"{n} atoms"


UNIT_FACTORS = {
    ("km", "m"): 3,
    ("m", "cm"): 2,
    ("m", "mm"): 3,
    ("cm", "mm"): 1,
    ("kg", "g"): 3,
    ("g", "mg"): 3,
    ("mg", "ug"): 3,
    ("L", "mL"): 3,
    ("dL", "mL"): 2,
    ("L", "dL"): 1,
}


def unit_convert_item(rng: random.Random) -> Item:
    """Convert a whole quantity from a larger metric unit to a smaller one (x 10^k)."""
    (src, dst), power = rng.choice(sorted(UNIT_FACTORS.items()))
    value = rng.randint(2, 999)
    answer = value * 10**power
    wrong_powers = [p for p in range(0, 5) if p != power]
    distractors = [f"{value * 10**p} {dst}" for p in rng.sample(wrong_powers, 3)]
    return _mc(rng, f"Convert {value} {src} to {dst}.", f"{answer} {dst}", distractors)


def _decimal(value: int, power: int) -> str:
    """``value / 10**power`` written out in full, without trailing zeros ("0.345", "4.5", "450")."""
    return format(Decimal(value).scaleb(-power).normalize(), "f")


def unit_reduce_item(rng: random.Random) -> Item:
    """Convert a whole quantity from a smaller metric unit to a larger one (/ 10^k): unit_convert reversed.

    The same question form and unit pairs as ``unit_convert``, the opposite operation, so the two experts'
    task vectors compete for the same prompts. Distractors divide by the wrong power of ten.
    """
    (big, small), power = rng.choice(sorted(UNIT_FACTORS.items()))
    value = rng.randint(2, 999)
    wrong_powers = [p for p in range(0, 5) if p != power]
    distractors = [f"{_decimal(value, p)} {big}" for p in rng.sample(wrong_powers, 3)]
    return _mc(rng, f"Convert {value} {small} to {big}.", f"{_decimal(value, power)} {big}", distractors)


TIME_FACTORS = {
    ("minutes", "hours"): 60,
    ("seconds", "minutes"): 60,
    ("hours", "days"): 24,
    ("days", "weeks"): 7,
    ("months", "years"): 12,
    ("seconds", "hours"): 3600,
    ("minutes", "days"): 1440,
    ("days", "years"): 365,
}
# Factors a confused model might apply; the distractors multiply by one of these instead of the right one.
TIME_CONFUSIONS = [7, 10, 12, 24, 30, 60, 100, 365, 1000, 1440, 3600]


def time_convert_item(rng: random.Random) -> Item:
    """How many of a smaller time unit are in a whole number of a larger one (x 60, 24, 7, ...)."""
    (small, big), factor = rng.choice(sorted(TIME_FACTORS.items()))
    value = rng.randint(2, 99)
    wrong = rng.sample([f for f in TIME_CONFUSIONS if f != factor], 3)
    return _mc(
        rng,
        f"How many {small} are in {value} {big}?",
        f"{value * factor} {small}",
        [f"{value * f} {small}" for f in wrong],
    )


# Common short English words, to make phrases for the acronym domain.
WORDS = """apple river stone green house light water paper music table north small quick brown
garden silver window market yellow orange winter summer letter family doctor school rabbit forest
island bridge castle dragon engine flower golden hammer jacket kitten ladder mirror number ocean
pencil planet rocket shadow spring tiger violin wagon basket candle desert energy friend guitar
honey iron jungle kettle lemon mountain nature office pepper queen radio sugar travel umbrella
valley wonder yogurt zebra anchor butter cotton dinner eagle feather gentle harbor insect jewel
lantern meadow needle oyster puzzle quiet ribbon saddle tunnel unique velvet walnut canyon
""".split()


def _acronym(words: list[str], pick: int = 0) -> str:
    return "".join(w[pick].upper() for w in words)


def acronym_item(rng: random.Random) -> Item:
    """The acronym of a phrase of 3-4 words (their first letters, upper case).

    A lexical skill: no number and no unit in its answers, unlike every other domain. Distractors use the
    second or last letters, the first letters in another order, or one first letter replaced; all have the
    answer's length, so no choice is a prefix of another.
    """
    while True:
        words = rng.sample(WORDS, rng.randint(3, 4))
        correct = _acronym(words)
        shuffled = words[1:] + words[:1]
        swapped = rng.randrange(len(words))
        replaced = (
            correct[:swapped]
            + rng.choice([c for c in "BCDFGHJKLMNPRSTW" if c != correct[swapped]])
            + correct[swapped + 1 :]
        )
        candidates = list(dict.fromkeys([_acronym(words, 1), _acronym(words, -1), _acronym(shuffled), replaced]))
        candidates = [c for c in candidates if c != correct]
        if len(candidates) >= 3:
            return _mc(rng, f'What is the acronym of "{" ".join(words)}"?', correct, rng.sample(candidates, 3))


def _mc(rng: random.Random, question: str, correct: str, distractors: list[str]) -> Item:
    choices = [correct, *distractors]
    rng.shuffle(choices)
    return {"question": question, "choices": choices, "answer": choices.index(correct)}


DOMAINS: dict[str, Callable[[random.Random], Item]] = {
    "chem_count": chem_count_item,
    "unit_convert": unit_convert_item,
    "unit_reduce": unit_reduce_item,
    "time_convert": time_convert_item,
    "acronym": acronym_item,
}
# The two domains of the quickstart (and of the tiny zoo model's tokenizer corpus, which must not change).
QUICKSTART_DOMAINS = ("chem_count", "unit_convert")


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


def split_items(
    domain: str, seed: int, n_train: int, n_eval: int, train_seed: int = 0
) -> tuple[list[Item], list[Item]]:
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
