"""The papers' mini reproductions, reduced, held to the verdicts their specs recorded.

Every setup of a spec on the search path that has a ``reduced:`` entry is run
here: ``python -m mergeval -m +experiment=<setup's experiment> <overrides>``,
then ``python -m mergeval.verify <spec> --run <its sweep> --tag <tags>
--recorded <verdicts>``. The test fails when a recorded verdict changes and it
was recorded at least one stderr from its threshold (mergeval/verify/recorded.py);
closer ones are printed only. Adding a paper is one ``reduced:`` entry in its
spec's setup plus the ``verdicts:`` record (``verify --record``) of that run::

    setups:
      mini:
        experiment: cmm_mini
        reduced:
          overrides: [benchmark.n_items=60, ...]   # what makes it small: fewer items, methods (none: the whole mini)
          tags: [mini]                              # the claims it checks
          verdicts: ci                              # the record it must reproduce (the mini's own for a whole mini)
          # or one record per precision the run computes in (mergeval/core/precision.py: bfloat16 where the CPU
          # runs it natively, else float32), since the two give different experts and scores:
          # verdicts: {bfloat16: ci, float32: ci_float32}

Every reduced setup trains its experts as its mini does (12 x 16; the
medical parents 30 x 16): an expert trained less than that leaves a
precondition, and with it the central finding, undecided. Setups that use the
same domains share them: the xdist workers share the experts' cache
(conftest.py) and the reduced runs share one results store, so a base or
expert evaluated for one paper on the same items is reused by the next
(MergeBench's reduced run asks for CMM's 100 items per task for that reason). Setups whose experiments use the same modelset run one after another in
one test class (the second reuses all the first built and evaluated); each
class is a unit of work of its own under ``--dist loadscope``, so the groups
run on both workers: the largest group first, the others after the other slow
modules (conftest.py), by when the first has built the experts they share. A
second builder of an expert waits for the first (``mergeval.core.paths.one_builder``),
a second evaluator of a model for the first (the store's claims): nothing is
computed twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mergeval.verify import available, load_spec
from tests.child import run_module


def reduced_setups() -> list[tuple[str, str, dict]]:
    """(spec, setup, its ``reduced`` entry) for every reduced mini setup on the spec search path."""
    out = []
    for name in available():
        for setup_name, setup in load_spec(name).setups.items():
            if isinstance(setup, dict) and setup.get("reduced"):
                out.append((name, setup_name, setup))
    return out


CASES = reduced_setups()


def records(reduced: dict) -> dict[str | None, list[str]]:
    """precision -> the records a reduced run in that precision must keep (None: any precision). Several
    records are the same runs on different machines: the run is held to what they agree on (recorded.combine)."""
    named = reduced["verdicts"]
    by_dtype = dict(named) if isinstance(named, dict) else {None: named}
    return {dtype: [names] if isinstance(names, str) else list(names) for dtype, names in by_dtype.items()}


def record_for(reduced: dict, sweep) -> list[str]:
    """The records for the precision the reduced run computed in (read from its first job's result.json)."""
    by_dtype = records(reduced)
    if None in by_dtype:
        return by_dtype[None]
    first = min(sweep.glob("*/result.json"))
    dtype = json.loads(first.read_text())["config"]["eval"]["dtype"]
    assert dtype in by_dtype, f"no verdicts recorded for runs in {dtype}: record them with verify --record"
    return by_dtype[dtype]


@pytest.fixture(scope="session")
def reproductions_store(tmp_path_factory) -> str:
    """One results store for every reduced run of the session, whichever worker runs it."""
    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    return str(shared / "reproductions-results.sqlite")


def run_reduced(name: str, setup: dict, tmp_path, store: str) -> None:
    reduced = setup["reduced"]
    sweep = tmp_path / "multirun"
    run = run_module(
        "mergeval",
        "-m",
        f"+experiment={setup['experiment']}",
        *reduced["overrides"],
        f"store.path={store}",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    tags = [arg for tag in reduced["tags"] for arg in ("--tag", tag)]
    held_to = [arg for record in record_for(reduced, sweep) for arg in ("--recorded", record)]
    check = run_module("mergeval.verify", name, "--run", str(sweep), *tags, *held_to, cwd=tmp_path)
    print(check.stdout)  # the comparison, changes that are not enforced included (shown with -s or on failure)
    assert check.returncode == 0, check.stdout[-6000:] + check.stderr[-1000:]


def modelset_of(setup: dict) -> str:
    """The modelset the setup's experiment selects (its YAML's ``override /modelset``)."""
    import yaml

    import mergeval

    path = Path(mergeval.__file__).parent / "run" / "conf" / "experiment" / f"{setup['experiment']}.yaml"
    for entry in yaml.safe_load(path.read_text()).get("defaults", []):
        if isinstance(entry, dict) and "override /modelset" in entry:
            return entry["override /modelset"]
    return "default"


def groups(cases: list[tuple[str, str, dict]]) -> list[tuple[str, list]]:
    """(modelset, its setups) for the reduced setups, the group with the most setups first."""
    by_modelset: dict[str, list] = {}
    for case in cases:
        by_modelset.setdefault(modelset_of(case[2]), []).append(case)
    return sorted(by_modelset.items(), key=lambda kv: -len(kv[1]))


def _group_class(modelset: str, cases: list, first: bool) -> type:
    """A test class running the setups of one modelset in turn: one unit of work under ``--dist loadscope``.
    ``first``: conftest.py schedules it at the start, the others after the other slow modules."""

    @pytest.mark.parametrize("name,setup_name,setup", cases, ids=[f"{n}-{s}" for n, s, _ in cases])
    def test_reduced_reproduction_keeps_its_recorded_verdicts(
        self, name, setup_name, setup, cache, tmp_path, reproductions_store
    ):
        run_reduced(name, setup, tmp_path, reproductions_store)

    cls_name = "TestReduced_" + "".join(part.title() for part in modelset.split("_"))
    return type(
        cls_name,
        (),
        {
            "test_reduced_reproduction_keeps_its_recorded_verdicts": test_reduced_reproduction_keeps_its_recorded_verdicts,
            "first": first,
            "__module__": __name__,
        },
    )


for _i, (_modelset, _cases) in enumerate(groups(CASES)):
    _cls = _group_class(_modelset, _cases, first=_i == 0)
    globals()[_cls.__name__] = _cls


# After the setups' classes: the first units of work xdist hands out are the long runs.
def test_every_reduced_setup_is_well_formed():
    assert CASES, "no spec setup declares a reduced: entry"
    for name, setup_name, setup in CASES:
        reduced = setup["reduced"]
        assert set(reduced) == {"overrides", "tags", "verdicts"}, (name, setup_name, reduced)
        spec = load_spec(name)
        assert set(records(reduced)) <= {None, "bfloat16", "float32"}, (name, reduced["verdicts"])
        for record in {r for names in records(reduced).values() for r in names}:
            assert record in spec.verdicts, f"{name}: no verdicts: {record} record"
            tagged = {c.id for c in spec.claims if set(c.tags) & set(reduced["tags"])}
            recorded = {cid.split(" (")[0] for cid in spec.verdicts[record].claims}
            assert recorded == tagged, f"{name}: {record} does not cover exactly the claims tagged {reduced['tags']}"
