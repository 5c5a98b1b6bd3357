"""What each stage costs, counted from the data so the numbers do not depend on caching.

Unit: one forward pass is one sequence scored by the model, teacher forced.
Stage 1 scores one sequence per held-out text (``staged.nll``); a benchmark
item costs one log-likelihood request, hence one sequence, per answer choice
(lm-eval's ``multiple_choice``). Examples are the texts / benchmark items
themselves. (lm-eval can serve several one-token continuations of one context
with a single model row; the counts here are the requests before that
optimisation, the unit in which the guide counts a benchmark's forward passes.)
Evaluations reused from the results store are still counted: the costs are what
the procedure needs, so staged and full evaluation compare on equal terms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Cost:
    examples: int = 0
    forward_passes: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.examples + other.examples, self.forward_passes + other.forward_passes)

    def __mul__(self, k: int) -> Cost:
        return Cost(self.examples * k, self.forward_passes * k)


def perplexity_cost(texts_per_task: Mapping[str, int]) -> Cost:
    """One model on the held-out texts: one example and one forward pass per text."""
    n = sum(texts_per_task.values())
    return Cost(n, n)


def benchmark_cost(choices: Mapping[str, Sequence[int]], start: int, stop: int) -> Cost:
    """One model on items ``[start, stop)`` of every task: ``choices[task][i]`` forward passes for item i."""
    return Cost(sum(len(c[start:stop]) for c in choices.values()), sum(sum(c[start:stop]) for c in choices.values()))


def cost_table(
    n_candidates: int,
    texts_per_task: Mapping[str, int],
    reference_texts: int,
    choices: Mapping[str, Sequence[int]],
    n_full: int,
    n_stage2_items: int,
    n_stage2: int,
    n_stage3: int,
) -> dict[str, Cost]:
    """Per stage and in total, for a sweep of ``n_candidates``, next to full evaluation of every candidate.

    stage1 = candidates x held-out texts + ``reference_texts`` (each expert on its own task's texts);
    stage2 = ``n_stage2`` candidates x items [0, n_stage2_items);
    stage3 = ``n_stage3`` candidates x items [n_stage2_items, n_full) (the first
    items were scored in stage 2 and are combined, not rerun);
    full = every candidate x items [0, n_full). The constituents' own full
    evaluation is the same for both procedures and is left out of both.
    """
    stage1 = perplexity_cost(texts_per_task) * n_candidates + Cost(reference_texts, reference_texts)
    stage2 = benchmark_cost(choices, 0, n_stage2_items) * n_stage2
    stage3 = benchmark_cost(choices, n_stage2_items, n_full) * n_stage3
    return {
        "stage1": stage1,
        "stage2": stage2,
        "stage3": stage3,
        "staged": stage1 + stage2 + stage3,
        "full": benchmark_cost(choices, 0, n_full) * n_candidates,
    }


def fractions(table: Mapping[str, Cost]) -> dict[str, float | None]:
    """The staged total as a fraction of full evaluation, in forward passes and in examples."""
    staged, full = table["staged"], table["full"]
    return {
        "forward_passes": staged.forward_passes / full.forward_passes if full.forward_passes else None,
        "examples": staged.examples / full.examples if full.examples else None,
    }


def as_json(table: Mapping[str, Cost]) -> dict:
    return {stage: asdict(cost) for stage, cost in table.items()} | {"fraction_of_full": fractions(table)}
