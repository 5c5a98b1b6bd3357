"""mkdocs hooks (``hooks:`` in mkdocs.yml): the reference pages, generated from the code at every build.

Nothing in ``docs/reference/`` is written by hand, so it cannot drift from the code:

* ``reference/methods.md``: every method in the registry (``mergeval.methods.METHODS``) with its formula (the
  merge function's docstring), kind, implementation version, every parameter of its config schema with the
  default and the comment beside the field, and the ``conf/method`` presets built on that schema;
* ``reference/config.md``: every field of every structured-config schema registered in Hydra's ConfigStore
  (``run_schema``, ``modelset_schema``, ``benchmark_schema``, ``metric_schema``, ``search_run_schema``), with
  its type, default and comment, and every option of every config group in ``conf/``;
* ``reference/cli.md``: the ``--help`` of every command line (``python -m mergeval...``), run at build time;
* ``reference/metrics.md``: every public function of ``mergeval/metrics`` with its signature and docstring;
* ``measurements.md``: ``benchmarks/RESULTS.md`` as it is, and on ``performance.md`` its "Current figures"
  table, copied in where the page says ``<!-- current-figures -->``: the figures live in that file only.

A method or metric without a docstring, a missing table marker or a command whose ``--help`` fails stops the
build with an error naming it (strict or not).
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # document this checkout's code, whatever copy is installed

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
FIGURES_START, FIGURES_END = "<!-- current-figures:start -->", "<!-- current-figures:end -->"
FIGURES_HERE = "<!-- current-figures -->"

# Public functions of mergeval/metrics that are plumbing, not metrics, and have no docstring of their own. Anything
# else public there without a docstring fails the build.
METRIC_HELPERS = {
    "mergeval.metrics.paired.total": "the sum of several Linear forms (adds their terms); used by paired_stderr's "
    "callers to combine a claim's two sides",
    "mergeval.metrics.composed.forgetting_of_merge": "metric.forgetting_tasks wired to groups.forgetting: the "
    "merged model's drop below the base on those tasks",
}
CONFIG_GROUPS = ("experiment", "method", "modelset", "benchmark", "metric", "search", "hydra/launcher")


# ---------------------------------------------------------------- mkdocs events


def on_files(files, config):
    pages = {
        "reference/methods.md": methods_page,
        "reference/config.md": config_page,
        "reference/cli.md": cli_page,
        "reference/metrics.md": metrics_page,
        "measurements.md": measurements_page,
    }
    for uri, build in pages.items():
        files.append(File.generated(config, uri, content=build()))
    return files


def on_page_markdown(markdown, page, config, files):
    if FIGURES_HERE in markdown:
        markdown = markdown.replace(FIGURES_HERE, current_figures())
    return markdown


# ---------------------------------------------------------------- helpers


def doc_block(text: str) -> str:
    """A docstring as written (indentation and alignment kept): a fenced text block."""
    return "```text\n" + inspect.cleandoc(text) + "\n```"


def cell(text: object) -> str:
    """Text for a Markdown table cell: one line; outside code spans, pipes escaped and ``<``/``>`` written as
    entities (``<cache_dir>`` would otherwise be taken for an HTML tag)."""
    parts = re.split(r"(`+[^`]*`+)", " ".join(str(text).split()))
    return "".join(
        part if part.startswith("`") else part.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        for part in parts
    )


def fmt_default(value: object) -> str:
    if value is dataclasses.MISSING or value == "???":
        return "(required)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if dataclasses.is_dataclass(value):
        return "(see its fields)"
    if isinstance(value, (list, dict)):
        return f"`{json.dumps(value)}`" if value else ("`[]`" if isinstance(value, list) else "`{}`")
    return f"`{value}`"


def fmt_type(kind: object) -> str:
    text = kind.__name__ if isinstance(kind, type) and not typing.get_args(kind) else str(kind)
    text = re.sub(r"\b(?:typing|mergeval(?:\.\w+)*)\.", "", text)
    return f"`{text.replace('NoneType', 'None')}`"


def default_of(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment on its line and the comment lines right above it, from the class's source
    (classes of the MRO without source, such as the registry's derived configs, add nothing)."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        lines = src.splitlines()
        comments = {
            tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(src).readline)
            if tok.type == tokenize.COMMENT
        }
        node = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef))
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above, line = [], item.lineno - 1
            while line >= 1 and line in comments and lines[line - 1].lstrip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            beside = [comments[n] for n in range(item.lineno, item.end_lineno + 1) if n in comments]
            text = " ".join(above + beside)
            if text:
                found[item.target.id] = text
    return found


def own_docstring(cls: type) -> str:
    """A dataclass's docstring, unless it is the one dataclasses writes (its signature)."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(cls.__name__ + "(") else doc


def yaml_comment(path: Path) -> str:
    """The comment lines at the top of a config YAML (Hydra's ``# @package`` line left out)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            out.append(line.lstrip("#").strip())
    return " ".join(out)


def _extended(path: Path) -> list[tuple[str, Path]]:
    """The configs a config YAML's defaults list names (``_self_`` left out): (the entry's config name, where
    its file would be). An entry is relative to the file's folder, or absolute from ``conf/`` when it starts with
    ``/`` (a paper's preset, ``conf/method/<paper>/<name>.yaml``, extends ``/method/<method>@_here_``)."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    out = []
    for entry in data.get("defaults", []) if isinstance(data, dict) else []:
        if not isinstance(entry, str) or entry == "_self_":
            continue
        name = entry.split("@")[0]
        where = (ROOT / "conf" / name.lstrip("/")) if name.startswith("/") else (path.parent / name)
        out.append((name.rpartition("/")[2], where.with_name(where.name + ".yaml")))
    return out


def schema_of(path: Path) -> str | None:
    """The ``*_schema`` a config YAML's defaults list extends, directly or through another config file
    (``cmm_chem/reverse.yaml`` extends ``cmm.yaml``, which extends ``cmm_schema``)."""
    for name, file in _extended(path):
        if name.endswith("_schema"):
            return name
        if file.is_file():
            return schema_of(file)
    return None


def based_on(path: Path) -> str | None:
    """The config file a config YAML extends, if any, as its option name (``cmm``)."""
    return next((name for name, file in _extended(path) if file.is_file()), None)


# ---------------------------------------------------------------- merge methods


def methods_page() -> str:
    from mergeval.methods import METHODS
    from mergeval.methods.registry import RULES_DOC

    missing = sorted(name for name, m in METHODS.items() if not m.doc.strip())
    if missing:
        raise PluginError(
            f"merge method(s) {', '.join(missing)} have no docstring: write the formula in the "
            "merge function's docstring (docs/reference/methods.md is built from it)"
        )
    conf = ROOT / "conf" / "method"
    presets: dict[str, list[Path]] = {}
    for path in sorted(conf.rglob("*.yaml"), key=lambda p: (len(p.relative_to(conf).parts), p)):
        schema = schema_of(path)
        if schema:
            presets.setdefault(schema.removesuffix("_schema"), []).append(path)

    out = [
        "# Merge methods",
        "",
        "Generated from the method registry (`mergeval/methods/`) and each method's config schema at every "
        "build of this site: what you read here is what the code does. Choose a method with "
        "`method=<name>` and set a parameter with `method.<field>=<value>`; the other files of "
        "`conf/method/` are named configurations of these methods, a paper's in its own folder "
        "(`method=<paper>/<name>`). How methods are chosen and combined is "
        "under [Concepts: method](../concepts/method.md).",
        "",
        "Notation in the formulas: base `b`, expert `e_i`, task vector `d_i = e_i - b`, weights `w_i`, "
        "`lambda` for `lambda_`.",
        "",
        "| method | kind | version | what it is (the docstring's first line) |",
        "|---|---|---|---|",
    ]
    for name, m in sorted(METHODS.items()):
        kind = "layer at a time" if m.merge_layer else "per tensor"
        out.append(f"| [`{name}`](#{name}) | {kind} | {m.version} | {cell(m.doc.splitlines()[0])} |")
    out += [
        "",
        "## Per-tensor rules and per-expert values",
        "",
        "Every method's config also takes `rules` (and, for methods with `weights`, `per_expert`), added by "
        "the registry:",
        "",
        doc_block(RULES_DOC),
        "",
    ]
    for name, m in sorted(METHODS.items()):
        comments = field_comments(m.config)
        hints = typing.get_type_hints(m.config)
        out += [f"## `{name}` {{#{name}}}", "", doc_block(m.doc), ""]
        facts = [
            f"kind: {'layer at a time' if m.merge_layer else 'per tensor'}",
            f"implementation version {m.version} (part of every stored merge's key)",
        ]
        if m.rows is not None:
            facts.append("large tensors merged in row blocks")
        out += ["; ".join(facts) + ".", ""]
        out += ["Declared at registration (`needs`, `mergekit`):", ""]
        out += [f"- {cell(line)}" for line in m.requirements()] + [""]
        doc = own_docstring(m.config.__mro__[1]) if len(m.config.__mro__) > 1 else ""
        if doc:
            out += [doc_block(doc), ""]
        out += ["| parameter | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(m.config):
            meaning = comments.get(f.name, "")
            if f.name == "rules":
                meaning = "per-tensor values: see [rules](#per-tensor-rules-and-per-expert-values)"
            elif f.name == "per_expert":
                meaning = "each expert's own weight, density, gamma, epsilon (mergekit's per-model parameters)"
            elif f.name == "name":
                meaning = "the method (`method=<name>` sets it)"
            out.append(f"| `{f.name}` | {fmt_type(hints[f.name])} | {fmt_default(default_of(f))} | {cell(meaning)} |")
        out.append("")
        if presets.get(name):
            out += ["Its files in `conf/method/` (`method=<path without .yaml>`):", ""]
            for path in presets[name]:
                import yaml

                values = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k != "defaults"}
                shown = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in values.items())
                parent = based_on(path)
                shown = (f"`{parent}` with " if parent else "") + (shown or "the defaults")
                option = path.relative_to(conf).with_suffix("").as_posix()
                out.append(f"- `{option}`: {cell(yaml_comment(path)) or 'no comment'} ({shown})")
            out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- config


def registered_schemas() -> dict[str, type]:
    """Every ``*_schema`` in Hydra's ConfigStore, as ``group/name`` -> its dataclass (method schemas left out:
    the methods page has them)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from mergeval.search.schema import register_search_configs

    register_search_configs()
    found: dict[str, type] = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}/")
            elif key.endswith("_schema.yaml") and prefix != "method/":
                found[prefix + key.removesuffix(".yaml")] = OmegaConf.get_type(value.node)

    walk(ConfigStore.instance().repo, "")
    return found


def schema_rows(cls: type, prefix: str, seen: set[str]) -> list[str]:
    """One table row per field, nested dataclasses (also inside dicts and optionals) expanded with dotted names."""
    rows = []
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        kind, dotted = hints[f.name], prefix + f.name
        if dotted in seen:
            continue
        seen.add(dotted)
        union = typing.get_origin(kind) in (typing.Union, types.UnionType)  # X | None
        options = [a for a in typing.get_args(kind) if a is not type(None)] if union else [kind]
        nested = next((o for o in options if dataclasses.is_dataclass(o)), None)
        value = next(
            (
                typing.get_args(o)[1]
                for o in options
                if typing.get_origin(o) is dict and dataclasses.is_dataclass(typing.get_args(o)[1])
            ),
            None,
        )
        if f.name == "method" and cls.__name__ == "RunConfig":
            rows.append(
                "| `method` | a method schema | `task_arithmetic` | the merge method: "
                "[every method's fields](methods.md) |"
            )
            continue
        rows.append(
            f"| `{dotted}` | {fmt_type(kind)} | {fmt_default(default_of(f))} | {cell(comments.get(f.name, ''))} |"
        )
        if nested is not None:
            rows += schema_rows(nested, dotted + ".", seen)
        if value is not None:
            rows += schema_rows(value, dotted + ".<name>.", seen)
    return rows


def config_page() -> str:
    schemas = registered_schemas()
    out = [
        "# Configuration",
        "",
        "Generated at every build from the structured-config schemas registered in Hydra's ConfigStore "
        "(`mergeval/run/config.py`, `mergeval/search/schema.py`) and from the YAML files of `conf/`. Every "
        "field below can be set on the command line (`eval.dtype=float32`) or in a YAML of your own; an "
        "unknown field or a value of the wrong type is a one-line error before anything runs. The merge "
        "methods' fields are on [Merge methods](methods.md).",
        "",
        "A default written `${mergeval_dtype:...}` or `${mergeval_backend:...}` is resolved when the "
        "config is read: bfloat16 where the device multiplies it natively, else float32, and the scorer "
        "that gives the `lm_eval` command line's answers in that precision.",
        "",
    ]
    order = [
        "run_schema",
        "modelset/modelset_schema",
        "benchmark/benchmark_schema",
        "metric/metric_schema",
        "search_run_schema",
    ]
    for key in order + sorted(set(schemas) - set(order)):
        if key not in schemas:
            raise PluginError(f"the config schema {key} is no longer registered: update docs/hooks.py's order")
        cls = schemas[key]
        group, _, name = key.rpartition("/")
        prefix = f"{group}." if group else ""
        seen: set[str] = set()
        title = {
            "run_schema": "The run (`python -m mergeval` and every command on its config tree)",
            "search_run_schema": "Recipe search (`python -m mergeval.search`): the `search` section",
        }
        out += [
            f"## {title.get(key, f'`{group}` ({name})')}",
            "",
            f"Schema `{name}`: `{cls.__module__}.{cls.__name__}`.",
            "",
        ]
        doc = own_docstring(cls)
        if doc:
            out += [cell(doc), ""]
        out += ["| field | type | default | meaning |", "|---|---|---|---|"]
        if key == "search_run_schema":
            search = next(f for f in dataclasses.fields(cls) if f.name == "search")
            out += schema_rows(typing.get_type_hints(cls)[search.name], "search.", seen)
        elif key == "run_schema":
            skip = {"modelset", "benchmark", "metric"}  # their own sections below
            rows = schema_rows(cls, prefix, seen)
            out += [r for r in rows if r.split("`")[1].split(".")[0] not in skip]
            out += [f"| `{g}` | `{g}` group | see below | the {g} (`{g}=<option>`) |" for g in sorted(skip)]
        else:
            out += schema_rows(cls, prefix, seen)
        out.append("")

    out += [
        "## Config groups and their options",
        "",
        "The files of `conf/`: choose one with `GROUP=OPTION` (an experiment with `+experiment=OPTION`). "
        "Each option's description is the comment at the top of its file.",
        "",
    ]
    for group in CONFIG_GROUPS:
        folder = ROOT / "conf" / group
        paths = sorted(p for p in folder.rglob("*.yaml") if not p.stem.endswith("_schema"))
        out += [f"### `{group}`", "", "| option | what it is |", "|---|---|"]
        out += [f"| `{p.relative_to(folder).with_suffix('').as_posix()}` | {cell(yaml_comment(p))} |" for p in paths]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- command lines


def commands() -> list[tuple[str, list[str]]]:
    """Every command line: ``mergeval`` and each of its modules with a ``__main__`` guard or a ``__main__.py``,
    in the order of ``mergeval.run.help.ENTRY_POINTS`` (others after it), and subcommands dispatched on argv[0]."""
    from mergeval.run.help import ENTRY_POINTS

    found = set()
    for path in (ROOT / "mergeval").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        if path.name == "__main__.py":
            found.add(".".join(rel.parts[:-1]))
        elif 'if __name__ == "__main__":' in path.read_text():
            found.add(".".join(rel.parts))
    listed = re.findall(r"python -m (\S+)", ENTRY_POINTS)
    ordered = [m for m in listed if m in found] + sorted(found - set(listed))
    out = []
    for module in ordered:
        source = ROOT / Path(*module.split("."))
        source = source / "__main__.py" if source.is_dir() else source.with_suffix(".py")
        out.append((module, []))
        for sub in re.findall(r'argv\[:1\] == \["(\w+)"\]', source.read_text()):
            out.append((module, [sub]))
    return out


def help_of(module: str, sub: list[str]) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="100", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", module, *sub, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise PluginError(
            f"python -m {module} {' '.join(sub)} --help failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    return done.stdout.rstrip()


def cli_page() -> str:
    from mergeval.run.help import ENTRY_POINTS

    listed = commands()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        helps = list(pool.map(lambda c: help_of(*c), listed))
    summaries = {m: s.strip() for m, s in re.findall(r"python -m (\S+)\s+(.+)", ENTRY_POINTS)}
    out = [
        "# Command lines",
        "",
        "Generated at every build: each command's own `--help`, as it prints it. The commands on the Hydra "
        "config tree (`mergeval`, `mergeval.merge`, `mergeval.check`, `mergeval.staged`, `mergeval.search`) "
        "take the same `GROUP=OPTION` and `field=value` overrides ([Configuration](config.md)); every "
        "mistake they can catch is one line on stderr and exit status 2.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for module, sub in listed:
        name = " ".join([f"python -m {module}", *sub])
        anchor = "-".join([module.replace(".", "-"), *sub])
        what = summaries.get(module, "") if not sub else helps[listed.index((module, sub))].split("\n\n")[1]
        out.append(f"| [`{name}`](#{anchor}) | {cell(what)} |")
    out.append("")
    for (module, sub), text in zip(listed, helps):
        name = " ".join([f"python -m {module}", *sub])
        anchor = "-".join([module.replace(".", "-"), *sub])
        out += [f"## `{name}` {{#{anchor}}}", "", "```text", text, "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------- metrics


def metric_functions() -> dict[str, list[tuple[str, object]]]:
    """Module -> its public functions and classes (defined there, not imported), for every module of
    mergeval/metrics."""
    import mergeval.metrics

    out = {}
    for info in sorted(pkgutil.iter_modules(mergeval.metrics.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"mergeval.metrics.{info.name}")
        out[module.__name__] = [
            (n, obj)
            for n, obj in vars(module).items()
            if not n.startswith("_")
            and (inspect.isfunction(obj) or inspect.isclass(obj))
            and obj.__module__ == module.__name__
        ]
    return out


class _Written(str):
    """An annotation kept as the source writes it (``from __future__ import annotations`` leaves strings)."""

    def __repr__(self) -> str:
        return str(self)


def signature_of(name: str, obj: object) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params = [
        p.replace(annotation=_Written(p.annotation)) if isinstance(p.annotation, str) else p
        for p in sig.parameters.values()
    ]
    ret = sig.return_annotation
    return name + str(sig.replace(parameters=params, return_annotation=_Written(ret) if isinstance(ret, str) else ret))


def metrics_page() -> str:
    found = metric_functions()
    undocumented = [
        f"{m}.{n}"
        for m, items in found.items()
        for n, obj in items
        if not (obj.__doc__ or "").strip() and f"{m}.{n}" not in METRIC_HELPERS
    ]
    if undocumented:
        raise PluginError(
            f"metric function(s) without a docstring: {', '.join(undocumented)}; write the "
            "formula in the docstring (docs/reference/metrics.md is built from it)"
        )
    out = [
        "# Metrics",
        "",
        "Generated at every build from `mergeval/metrics/`: each module's description, then every public "
        "function with its signature and docstring (the formula). These are pure functions of score "
        "tables and tensors; which of them a run reports is chosen by the `metric` group "
        "([Concepts: metric](../concepts/metric.md)).",
        "",
    ]
    for module, items in found.items():
        mod = sys.modules[module]
        short = module.rsplit(".", 1)[1]
        out += [f"## `{short}` {{#{short}}}", "", doc_block(mod.__doc__ or ""), ""]
        for name, obj in items:
            signature = signature_of(name, obj)
            doc = (obj.__doc__ or "").strip()
            if inspect.isclass(obj) and doc.startswith(name + "("):
                doc = ""
            doc = doc or METRIC_HELPERS.get(f"{module}.{name}", "")
            out += [f"### `{name}` {{#{short}-{name.lower()}}}", "", "```python", signature, "```", ""]
            if doc:
                out += [doc_block(doc), ""]
    return "\n".join(out)


# ---------------------------------------------------------------- figures


def current_figures() -> str:
    text = RESULTS.read_text()
    if FIGURES_START not in text or FIGURES_END not in text:
        raise PluginError(f"{RESULTS} lost its {FIGURES_START} / {FIGURES_END} markers around the current figures")
    return text.split(FIGURES_START, 1)[1].split(FIGURES_END, 1)[0].strip()


def measurements_page() -> str:
    return RESULTS.read_text()
