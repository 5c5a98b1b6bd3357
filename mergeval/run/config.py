"""The run-config schema: dataclasses registered in Hydra's ConfigStore.

Every YAML under ``conf/`` extends one of these schemas (``defaults: [<x>_schema]``),
so an unknown key or a value of the wrong type fails when Hydra composes the
config, before anything runs. Method schemas live beside their merge function
(``mergeval/methods``) and are registered here under ``method/<name>_schema``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from mergeval.core.precision import register_resolver
from mergeval.methods import METHODS

register_resolver()  # the dtype defaults below interpolate it


@dataclass
class TrainConfig:
    """How zoo experts are fine-tuned from the modelset's base (part of each expert's cache key)."""

    steps: int = 30
    batch_size: int = 16
    lr: float = 5e-5
    seed: int = 0
    # compute precision of the fine-tuning's matrix products: bfloat16 (autocast) where the CPU runs it natively,
    # else float32 (mergeval/core/precision.py); part of the expert's cache key when not bfloat16
    dtype: str = "${mergeval_dtype:cpu}"


@dataclass
class CalibrationConfig:
    """An expert's calibration data for data-aware merges (fisher, regmean; mergeval/merge/expert_statistics.py)."""

    task: str | None = None  # a generated domain (chem_count), generated task (mergeval_chem_count) or lm-eval task
    split: str = "train"  # train | validation; never test (the items the merge is scored on)
    n: int = 64  # items


@dataclass
class ExpertConfig:
    """One constituent to merge: an existing model (``source``) or one mergeval fine-tunes (``domain``)."""

    source: str | None = None  # hf:<id>, a local directory, smollm2, zoo:tiny
    domain: str | None = None  # fine-tune the modelset's base on this generated domain
    task: str | None = None  # the benchmark task that measures this expert's own skill
    calibration: CalibrationConfig | None = None  # data for fisher / regmean statistics (null: none)


@dataclass
class SliceSourceConfig:
    """A range of one model's decoder layers (mergeval/merge/slices.py)."""

    model: str = MISSING  # base, or an expert's name in the modelset
    layer_range: list[int] = MISSING  # [start, end): layers start to end - 1


@dataclass
class SliceConfig:
    """One output slice: its sources' layers merged by the run's method (one source: passthrough)."""

    sources: list[SliceSourceConfig] = field(default_factory=list)


@dataclass
class ModelsetConfig:
    name: str = MISSING
    base: str = MISSING
    experts: dict[str, ExpertConfig] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    # layer slices (a frankenmerge, mergekit's slices:): the merged model stacks them in order; empty: whole models
    slices: list[SliceConfig] = field(default_factory=list)


@dataclass
class BenchmarkConfig:
    """The tasks a run evaluates (mergeval/eval/suite.py): generated, lm-eval registry, or from include_path."""

    name: str = MISSING
    # lm-eval task, group or tag names (hellaswag, gsm8k, mmlu), tasks of include_path, or mergeval_* generated
    tasks: list[str] = field(default_factory=list)
    include_path: list[str] = field(default_factory=list)  # directories of task YAMLs; shipped:<dir> ships with us
    # task -> "metric,filter" reported (default: eval/metric_choice.py), e.g. {gsm8k: "exact_match,strict-match"}
    metrics: dict[str, str] = field(default_factory=dict)
    num_fewshot: int | None = None  # all tasks, as lm_eval --num_fewshot; null: each task's own default
    fewshot: dict[str, int] = field(default_factory=dict)  # per task (or group): always applied
    # task -> {split: file}: a registry task's own definition over local JSON-lines files (shipped:<file> too)
    data: dict[str, dict[str, str]] = field(default_factory=dict)
    n_items: int = 200  # items per generated task
    limit: int | None = None  # evaluate only the first N items of each task (reduced runs)
    # task YAMLs of include_path that load Python (lm-eval's !function) run it: only when this is true
    allow_task_code: bool = False


@dataclass
class MetricGroup:
    """Tasks averaged together; ``scale`` multiplies their scores first (e.g. 100 to put 0-1 on 0-100)."""

    tasks: list[str] = field(default_factory=list)
    scale: float = 1.0


@dataclass
class MetricConfig:
    name: str = "default"
    scale: str = "percent"  # Macro-Gain / Macro-OG reported in "percent" points or as a "fraction"
    groups: dict[str, MetricGroup] = field(default_factory=dict)  # per-role weighted mean over task groups
    weighting: str = "tasks"  # groups weighted by their task count ("tasks"), "equal", or "given" (weights)
    # {} (not null) by default, so metric.weights.<group>=2 can add a key from the command line; empty = not given
    weights: dict[str, float] | None = field(default_factory=dict)
    forgetting_tasks: list[str] = field(default_factory=list)  # general tasks: base - merged drop (MergeBench)
    # what Macro-Gain / Macro-OG compare the merge against: "experts" (the modelset's experts), "base_and_experts"
    # (the CPT paper's first stage, an expert merged with its own base), or a list of roles, e.g. [base, finance]
    constituents: Any = "experts"
    similarity: bool = False  # task-vector L2 / cosine / sign conflict / SAR between experts and the merge
    calibration: bool = False  # expected calibration error per model and task (from kept log-likelihoods)
    # [task_a, task_b] pairs asking the same items in two formats (X and its lettered X_mc): per model,
    # agreement of the argmax answers, accuracy in each format, share right in both (from kept log-likelihoods)
    consistency: list[list[str]] = field(default_factory=list)


@dataclass
class EvalConfig:
    batch_size: int = 32
    # evaluation precision (merging always runs in float32): by default bfloat16 where the device runs it
    # natively, else float32 (mergeval/core/precision.py); set bfloat16 or float32 to force one
    dtype: str = "${mergeval_dtype:${.device}}"
    # "shared_prefix": each question's context computed once for all choices (eval/scorer.py);
    # "hflm": lm-eval's HFLM as is (one sequence per choice), as the lm_eval CLI runs it. In float32 the same
    # answers up to float rounding; in bfloat16 HFLM takes the log-softmax in bfloat16 (shared_prefix: float32),
    # which flips near-tied answers (tests/eval/test_scorer_bf16.py).
    # "vllm": lm-eval's vLLM backend (GPU; the model written once to a temporary directory).
    # By default the lm_eval CLI's answers in the run's precision: shared_prefix in float32, hflm otherwise
    # (precision.auto_backend); resolved when the config is read, so result.json holds the one that ran.
    backend: str = "${mergeval_backend:${.dtype}}"
    # "auto": a CUDA GPU where torch sees one, else the CPU; resolved when the config is read, so result.json and
    # the store's keys hold the device that ran. Or name one: cpu, cuda, cuda:1, mps...
    device: str = "${mergeval_device:auto}"
    force: bool = False  # re-evaluate even when the results store already holds this evaluation
    # prompting, as lm_eval's flags of the same names (all part of the store key)
    apply_chat_template: bool = False
    system_instruction: str | None = None
    fewshot_as_multiturn: bool = False
    gen_kwargs: dict[str, Any] = field(default_factory=dict)  # generation tasks: e.g. {max_gen_toks: 256}
    # tasks that execute the code a model writes (humaneval_plus, mbpp_plus) run only when this is true
    allow_code_execution: bool = False


@dataclass
class MergeConfig:
    """Where the merge computes (mergeval/merge/execute.py, ``Device``)."""

    # cpu, cuda or cuda:K. By default the evaluation's device: a run on a GPU merges there, each tensor (or row
    # block) moved to it, merged, and brought back, one at a time; the CPU's bits for the elementwise and random
    # methods, within float32 rounding for those with reductions (docs/getting-started/gpu.md)
    device: str = "${eval.device}"


@dataclass
class StoreConfig:
    """The results store shared by all runs (evaluations, merges, runs): an SQLite file, or a PostgreSQL
    server that many machines share (mergeval/results/store.py, mergeval/results/backends)."""

    path: str | None = None  # an SQLite file; default: <cache_dir>/results.sqlite
    url: str | None = None  # postgresql://USER[:PASSWORD]@HOST[:PORT]/DB, sqlite:///FILE or a file (not with path)
    claim_timeout_s: float = 300.0  # another machine's evaluation claim not renewed this long is taken over


@dataclass
class SweepConfig:
    """How a multirun (``-m``) resumes and reports its progress (mergeval/run/resume.py, mergeval/run/progress.py).
    None of it is part of a job's configuration hash."""

    resume: bool = True  # skip a job whose configuration the results store has finished; false re-runs it
    progress: bool = True  # print jobs done / total, the best so far and the time left as jobs finish
    best: str = "macro_gain"  # the aggregate "best so far" ranks by: a key of result.json's aggregates (dots nest)
    minimize: bool = False  # the best is the lowest value of ``best`` (e.g. forgetting.mean)
    poll_s: float = 2.0  # how often the sweep's process reads the store for finished jobs


@dataclass
class StagedConfig:
    """A sweep evaluated in three stages (``python -m mergeval.staged``; see mergeval/staged)."""

    grid: dict[str, dict[str, list[Any]]] = field(default_factory=dict)  # method -> field -> values (all products)
    candidates: list[dict[str, Any]] = field(default_factory=list)  # explicit candidates: {name: <method>, field: v}
    heldout_items: int = 64  # held-out texts per task for stage 1's perplexity
    stage1_keep: int = 4  # candidates promoted by perplexity to stage 2
    stage2_fraction: float = 0.15  # share of each task's items in stage 2
    stage3_keep: int = 3  # candidates promoted by stage 2 to the full benchmark
    degrade_threshold: float = 1.0  # early stop if every candidate's held-out perplexity exceeds the experts' by this
    full: bool = False  # also run the full benchmark on every candidate and compare the picks
    keep_memory: float = 0.25  # share of free memory promoted candidates' weights may hold between stages (0: none)


@dataclass
class RunConfig:
    method: Any = MISSING
    modelset: ModelsetConfig = MISSING
    benchmark: BenchmarkConfig = MISSING
    metric: MetricConfig = MISSING
    eval: EvalConfig = field(default_factory=EvalConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    seed: int = 0
    cache_dir: str | None = None  # default: the user cache dir (or $MERGEVAL_CACHE)
    store: StoreConfig = field(default_factory=StoreConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    offline: bool = True  # hub ids resolve from the local Hugging Face cache only
    save_merged: bool = False  # also write the merged model as a Hugging Face directory
    # inputs with different vocabularies: error | base | truncate | union (mergeval.merge.vocab)
    vocab_policy: str = "error"
    # the merged model's tokenizer, the vocabularies aligned by token: null (the base's, by row) | base | union |
    # an expert's name (mergeval.merge.tokens; mergekit's tokenizer_source)
    tokenizer_source: str | None = None
    output: str | None = None  # python -m mergeval.merge writes here; default: <job dir>/merged_model
    # dtype of the floating tensors a saved merge is written in (merge-only output, save_merged): float32 |
    # bfloat16 | float16; null keeps each tensor's dtype in the base. Merging itself always runs in float32.
    out_dtype: str | None = None
    # the sweep of python -m mergeval.staged and of -m hydra/sweeper=staged (unused by a plain run)
    staged: StagedConfig | None = field(default_factory=StagedConfig)
    verbose: bool = False  # also show lm-eval's and transformers' own progress bars and warnings
    mergekit: str | None = None  # a mergekit YAML: its method and models replace method and modelset (interop/)


# A run config below the command line: as Hydra composed it (a DictConfig of the schema), or typed (``typed``). Both
# answer the same attribute reads; what runs after ``checks.validate`` gets the typed one.
RunCfg = RunConfig | DictConfig


def typed(cfg: Any) -> RunConfig:
    """The composed run config as its schema's dataclasses (``RunConfig``, or a command's subclass; the method as its
    own config class), every interpolation resolved: what a command's run sequence works on once ``checks.validate``
    has checked and completed the composed config. Code below the command line reads fields by attribute, which a
    composed ``DictConfig`` answers the same way."""
    if isinstance(cfg, RunConfig):
        return cfg
    return cast(RunConfig, OmegaConf.to_object(cfg))


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="modelset", name="modelset_schema", node=ModelsetConfig)
    cs.store(group="benchmark", name="benchmark_schema", node=BenchmarkConfig)
    cs.store(group="metric", name="metric_schema", node=MetricConfig)
    for name, method in METHODS.items():
        cs.store(group="method", name=f"{name}_schema", node=method.config)


def mapping_fields(schema=None, prefix: str = "", sections: dict | None = None) -> set[str]:
    """Dotted names of the schema's free mappings (``eval.gen_kwargs``, ``benchmark.fewshot``, ...): fields
    whose keys the user chooses, with values that have no fields of their own (not ``modelset.experts``,
    whose values are ExpertConfigs: a misspelt field of an expert must stay an error). Without ``schema``: the
    run config's and every method's (under ``method.``), and those of ``sections`` (a command's own top-level
    sections, such as mergeval.search's ``{"search": SearchConfig}``)."""
    if schema is None:
        found = mapping_fields(RunConfig)
        for name, section in (sections or {}).items():  # only the command that has a section: elsewhere ++ would add it
            found |= mapping_fields(section, f"{name}.")
        for method in METHODS.values():
            found |= mapping_fields(method.config, "method.")
        return found
    found = set()
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        union = typing.get_origin(kind) in (typing.Union, types.UnionType)  # X | None
        options = [a for a in typing.get_args(kind) if a is not type(None)] if union else [kind]
        for option in options:
            if typing.get_origin(option) is dict:
                if not dataclasses.is_dataclass(typing.get_args(option)[1]):  # experts' fields stay checked
                    found.add(prefix + f.name)
            elif dataclasses.is_dataclass(option):
                found |= mapping_fields(option, f"{prefix}{f.name}.")
    return found


def open_mappings(args: list[str], sections: dict | None = None) -> list[str]:
    """Command-line overrides of a mapping field or one of its keys (``eval.gen_kwargs={max_gen_toks: 256}``,
    ``benchmark.fewshot.mmlu=5``) as Hydra's ``++`` (set, or add). Why: Hydra composes the schema in struct
    mode, which refuses every key a mapping does not have yet, so the README's ``eval.gen_kwargs={...}`` failed
    with "no such field"; a mapping's keys are the user's to choose, and its values are still checked against
    the field's type. Everything else is left as it is (a misspelt field stays an error)."""
    fields = mapping_fields(sections=sections)
    return [open_key(arg, sections, fields) if "=" in arg else arg for arg in args]


def open_key(override: str, sections: dict | None = None, fields: set[str] | None = None) -> str:
    """``override`` (``key=value``, or a bare key as ``hydra.sweeper.params`` holds it) with Hydra's ``++`` in
    front where its key is a mapping field or one of its keys (``open_mappings``); otherwise unchanged."""
    fields = mapping_fields(sections=sections) if fields is None else fields
    key = override.split("=", 1)[0]
    if not override.startswith(("+", "~", "-")) and any(key == f or key.startswith(f + ".") for f in fields):
        return "++" + override
    return override


def sweep_sections(config) -> dict:
    """A composed config's top-level sections beyond the run config's, with their schemas (mergeval.search's
    ``search``): what ``open_mappings`` needs to open their mappings too, read from the config itself."""
    from omegaconf import DictConfig, OmegaConf

    run_fields = {f.name for f in dataclasses.fields(RunConfig)}
    return {
        key: OmegaConf.get_type(node)
        for key, node in config.items_ex(resolve=False)
        if key not in run_fields
        and key != "hydra"
        and isinstance(node, DictConfig)
        and dataclasses.is_dataclass(OmegaConf.get_type(node))
    }
