"""The documentation people read: a short README, a site that builds strictly, reference pages that list what the
code has, and the commands the pages show, run.

The reference pages are generated from the code at build time (docs/hooks.py); the tests here compare them with
the registries and schemas as the code reports them now, so a method, metric, config field or command line that
the pages miss fails here, and so does a method or metric without a docstring (the hook refuses to build). The
commands of getting started, the concepts and the guides that run in seconds on the tiny zoo are executed in
page order in one working directory, as a reader would paste them; the others are at least composed
(``--cfg job``) when they need no file of their own.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import shlex
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from tests.child import run_module

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# the pages whose commands a reader runs (the reference pages are generated, performance quotes RESULTS.md)
COMMAND_PAGES = ("getting-started/", "concepts/", "guides/")
TINY = re.compile(r"\+experiment=tiny\w*|\bbenchmark=tiny\b|\bmodelset=tiny\b|zoo:tiny")
# what marks a command as needing something of the reader's own: a placeholder, a recorded run's files, a server
PLACEHOLDERS = ("<", "...", "/tmp/", "path/to", "my-merge", "dbhost", "RUN_ID", "DIR", "FILE", "/models/")
# commands that only read (the store, reports, specs) or only print: seconds, whatever the store holds
CHEAP_MODULES = ("mergeval.report", "mergeval.results", "mergeval.verify")
HYDRA_MODULES = ("mergeval", "mergeval.merge", "mergeval.check", "mergeval.staged", "mergeval.search")


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- the README


def fenced(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of a Markdown text, in order (indented fences too)."""
    return [(m.group(2), m.group(3)) for m in re.finditer(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", text, flags=re.M | re.S)]


def two_commands(text: str) -> str:
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return next(body for lang, body in fenced(section) if lang == "bash")


def test_the_readme_is_short_and_keeps_the_two_commands_ci_runs():
    text = README.read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    commands = two_commands(text)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]  # the test command, exactly
    assert ci in commands.splitlines(), "README's command 2 is no longer the one .ci/run runs"
    assert commands == two_commands((DOCS / "getting-started" / "install.md").read_text()), (
        "the install page's two commands differ from the README's"
    )
    # after the two commands: no history, no hour-stamped timings, no commit narration, no CPU-family caveats
    rest = text.split("## Two commands", 1)[1].split("\n## ", 1)[1]
    for stale in (r"\b\d\d:\d\d-\d\d:\d\d\b", r"\bat [0-9a-f]{7}\b", r"\bon 20\d\d-\d\d-\d\d\b", r"AVX", r"\bAMX\b"):
        assert not re.search(stale, rest), (stale, re.search(stale, rest))


def test_the_readme_shows_how_to_merge_your_own_checkpoints_as_the_docs_do():
    """The README's own-models recipe is the getting-started page's, word for word (the page's is run below)."""
    readme, page = README.read_text(), (DOCS / "getting-started" / "your-models.md").read_text()
    yaml_block = own_models_yaml(page)
    command = own_models_command(page)
    assert yaml_block in readme and command in readme
    assert "method=ties" in command and "benchmark.tasks=[hellaswag]" in command


def test_every_link_of_the_readme_into_the_repository_exists():
    for target in re.findall(r"\]\(([^)#]+)\)", README.read_text()):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


# ---------------------------------------------------------------- the reference, against the code


def schema_fields(cls: type, prefix: str) -> set[str]:
    """Dotted names of a structured-config schema's fields, nested dataclasses expanded (a mapping's values under
    ``<name>``), as a user writes them on the command line."""
    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, dotted = hints[f.name], prefix + f.name
        out.add(dotted)
        union = typing.get_origin(kind) in (typing.Union, types.UnionType)
        for option in [a for a in typing.get_args(kind) if a is not type(None)] if union else [kind]:
            if dataclasses.is_dataclass(option):
                out |= schema_fields(option, dotted + ".")
            elif typing.get_origin(option) is dict and dataclasses.is_dataclass(typing.get_args(option)[1]):
                out |= schema_fields(typing.get_args(option)[1], dotted + ".<name>.")
    return out


def registered_schemas() -> dict[str, type]:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from mergeval.search.schema import register_search_configs

    register_search_configs()
    found = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}/")
            elif key.endswith("_schema.yaml"):
                found[prefix + key.removesuffix(".yaml")] = OmegaConf.get_type(value.node)

    walk(ConfigStore.instance().repo, "")
    return found


def section(markdown: str, anchor: str) -> str:
    """The Markdown of the heading with id ``anchor`` up to the next heading of its level or above."""
    match = re.search(rf"^(#+) .*\{{#{re.escape(anchor)}\}}$", markdown, flags=re.M)
    assert match, f"no heading #{anchor}"
    level = len(match.group(1))
    rest = markdown[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[: end.start()] if end else rest


def test_the_methods_page_lists_every_registered_method_with_every_parameter_and_default():
    from mergeval.methods import METHODS

    page = hooks().methods_page()
    assert len(METHODS) >= 20
    for name, method in METHODS.items():
        text = section(page, name)
        assert method.doc.strip().splitlines()[0] in text, name  # the formula's docstring
        assert f"implementation version {method.version}" in text, name
        for f in dataclasses.fields(method.config):
            row = next((line for line in text.splitlines() if line.startswith(f"| `{f.name}` |")), None)
            assert row is not None, f"{name}.{f.name}"
            if (
                f.default is not dataclasses.MISSING
                and isinstance(f.default, (int, float))
                and not isinstance(f.default, bool)
            ):
                assert f"`{f.default}`" in row, (name, f.name, row)
    # every conf/method file shows under the method whose schema it extends, a paper's presets by their option
    # (method=<paper>/<name>); and what each method declared at registration
    conf = ROOT / "conf" / "method"
    for path in conf.rglob("*.yaml"):
        option = path.relative_to(conf).with_suffix("").as_posix()
        assert f"- `{option}`:" in page, option
    cmm = section(page, "cmm")
    assert "- `cmm_chem/reverse`: " in cmm and "method.order=given" in cmm


def test_the_config_page_lists_every_field_of_every_registered_schema_and_every_group_option():
    page = hooks().config_page()
    schemas = {k: v for k, v in registered_schemas().items() if not k.startswith("method/")}
    assert {
        "run_schema",
        "modelset/modelset_schema",
        "benchmark/benchmark_schema",
        "metric/metric_schema",
        "search_run_schema",
    } <= set(schemas)
    fields: set[str] = set()
    for key, cls in schemas.items():
        group = key.rpartition("/")[0]
        assert f"Schema `{key.rpartition('/')[2]}`" in page, key
        if key == "search_run_schema":
            fields |= schema_fields(typing.get_type_hints(cls)["search"], "search.")
        else:
            fields |= schema_fields(cls, f"{group}." if group else "")
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    assert fields - {"method"} <= listed, sorted(fields - listed)
    assert "eval.dtype" in fields and "modelset.experts.<name>.source" in fields and "search.n_trials" in fields
    for group in ("experiment", "method", "modelset", "benchmark", "metric", "search", "hydra/launcher"):
        folder = ROOT / "conf" / group
        options = [p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml")]
        assert options, group
        block = page.split(f"### `{group}`", 1)[1].split("\n### ", 1)[0]
        for option in options:
            assert f"| `{option}` |" in block, (group, option)


def metric_functions() -> dict[str, list[str]]:
    import mergeval.metrics

    out = {}
    for info in pkgutil.iter_modules(mergeval.metrics.__path__):
        module = importlib.import_module(f"mergeval.metrics.{info.name}")
        out[info.name] = [
            n
            for n, obj in vars(module).items()
            if not n.startswith("_")
            and (isinstance(obj, types.FunctionType) or isinstance(obj, type))
            and obj.__module__ == module.__name__
        ]
    return out


def test_the_metrics_page_lists_every_metric_function_with_its_formula():
    page = hooks().metrics_page()
    found = metric_functions()
    assert {"aggregates", "groups", "paired", "similarity", "tradeoff", "uncertainty"} <= set(found)
    assert "macro_gain" in found["aggregates"] and "normalized_score" in found["aggregates"]
    for module, names in found.items():
        text = section(page, module)
        for name in names:
            assert f"### `{name}` {{#{module}-{name.lower()}}}" in text, f"{module}.{name}"
    macro_gain = section(page, "aggregates-macro_gain")
    assert "mean_t merged[t]" in macro_gain  # the docstring's formula itself


def test_a_method_or_metric_without_a_docstring_stops_the_build(monkeypatch):
    from mkdocs.exceptions import PluginError

    import mergeval.metrics.aggregates as aggregates
    from mergeval.methods import METHODS

    h = hooks()
    ties = METHODS["ties"]
    monkeypatch.setitem(METHODS, "undocumented", dataclasses.replace(ties, name="undocumented", doc=""))
    with pytest.raises(PluginError, match="undocumented"):
        h.methods_page()
    monkeypatch.delitem(METHODS, "undocumented")

    def silent_metric(scores):
        return sum(scores)

    silent_metric.__module__ = aggregates.__name__
    monkeypatch.setattr(aggregates, "silent_metric", silent_metric, raising=False)
    with pytest.raises(PluginError, match="silent_metric"):
        h.metrics_page()


def test_the_performance_page_takes_its_figures_from_results_md_only():
    h = hooks()
    table = h.current_figures()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| benchmark")]
    assert len(rows) >= 10
    for needed in (
        "merge_throughput.py --models quickstart",
        "sweep_cost.py",
        "run_memory.py",
        "command 1",
        "command 2",
    ):
        assert needed in table, needed
    performance = (DOCS / "performance.md").read_text()
    assert h.FIGURES_HERE in performance
    assert not re.search(r"\d+(\.\d+)?\s?(s|MiB)\b", performance.replace(h.FIGURES_HERE, "")), (
        "a figure written on the performance page instead of in benchmarks/RESULTS.md"
    )


# ---------------------------------------------------------------- the site, built strictly


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``mkdocs build --strict`` into a temporary directory (about 15 s: the reference pages run every command's
    --help), as CI's test command runs it."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert "WARNING" not in done.stderr, done.stderr[-6000:]
    return out


def test_the_site_builds_strictly_with_every_page(site):
    for page in (
        "index.html",
        "getting-started/your-models/index.html",
        "guides/reproductions/index.html",
        "reference/methods/index.html",
        "reference/config/index.html",
        "reference/cli/index.html",
        "reference/metrics/index.html",
        "performance/index.html",
        "measurements/index.html",
        "specs/index.html",
    ):
        assert (site / page).is_file(), page
    performance = (site / "performance" / "index.html").read_text()
    assert "merge_throughput.py --models quickstart" in performance and "<table>" in performance
    assert 'class="mermaid"' in (site / "index.html").read_text()


def test_the_command_line_page_shows_every_command_s_own_help(site):
    from mergeval.run.help import ENTRY_POINTS

    page = html.unescape((site / "reference" / "cli" / "index.html").read_text())
    modules = set(re.findall(r"python -m (\S+)", ENTRY_POINTS))
    for path in (ROOT / "mergeval").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        if path.name == "__main__.py":
            modules.add(".".join(rel.parts[:-1]))
        elif 'if __name__ == "__main__":' in path.read_text():
            modules.add(".".join(rel.parts))
    assert {
        "mergeval",
        "mergeval.merge",
        "mergeval.verify",
        "mergeval.check",
        "mergeval.search",
        "mergeval.results",
        "mergeval.report",
        "mergeval.staged",
    } <= modules
    for module in modules:
        assert f'id="{module.replace(".", "-")}"' in page, module
    assert "usage: python -m mergeval.verify" in page and "python -m mergeval.merge [+experiment=NAME]" in page
    assert "usage: python -m mergeval.results import" in page


# ---------------------------------------------------------------- the commands the pages show


@dataclasses.dataclass
class Shown:
    page: str
    kind: str  # "block": a bash block run as a script; "error"/"ok": one `$ ` command; "compose": --cfg job
    text: str  # the script, or the command
    expected: list[str] = dataclasses.field(default_factory=list)  # the error lines shown under an error command

    @property
    def id(self) -> str:
        return f"{self.page}:{self.kind}:{self.text.splitlines()[0][:60]}"


def command_pages() -> list[str]:
    """The pages a reader follows, in the site's navigation order."""
    return [
        m
        for m in re.findall(r"^\s*- [^:\n]+: ([\w/.-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
        if m.startswith(COMMAND_PAGES)
    ]


def commands_in(script: str) -> list[str]:
    """The ``python -m mergeval...`` commands of a shell script, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", script)
    out = []
    for line in joined.splitlines():
        line = line.strip().removeprefix("$ ")
        if line.startswith("python -m mergeval"):
            out.append(" ".join(shlex.quote(a) for a in shlex.split(line, comments=True)))
    return out


def module_of(command: str) -> str:
    return shlex.split(command)[2]


def cheap(command: str) -> bool:
    args = shlex.split(command)
    return module_of(command) in CHEAP_MODULES or "--help" in args or "--cfg" in args


def reads_earlier_output(command: str, block: list[str]) -> bool:
    """Whether a command reads what an earlier command of its block wrote (``output=mk/``, then
    ``mergekit=mk/mergekit.yaml``): it runs where that one does."""
    written = [
        a.split("=", 1)[1] for c in block[: block.index(command)] for a in shlex.split(c) if a.startswith("output=")
    ]
    return any(w and w in a for w in written for a in shlex.split(command)[3:] if not a.startswith("output="))


def shown_commands() -> tuple[list[Shown], list[str]]:
    """What the test runs, and the tiny commands it could not run (each must be in a block of its own)."""
    shown, orphans = [], []
    for page in command_pages():
        for lang, body in fenced((DOCS / page).read_text()):
            commands = commands_in(body)
            if not commands:
                continue
            placeholder = any(p in body for p in PLACEHOLDERS)
            if lang == "bash":
                if not placeholder and all(
                    TINY.search(c) or cheap(c) or reads_earlier_output(c, commands) for c in commands
                ):
                    shown.append(Shown(page, "block", body))
                    continue
                for c in commands:
                    if TINY.search(c) and "/tmp/" not in c:
                        orphans.append(f"{page}: {c}")
                    elif (
                        module_of(c) in HYDRA_MODULES
                        and not any(p in c for p in PLACEHOLDERS)
                        and not re.search(r"(^| )-m( |$)", c.split(" ", 3)[-1])
                        and "mergekit=" not in c
                    ):
                        shown.append(Shown(page, "compose", c))
                continue
            # a transcript: `$ command` lines, each followed by what it printed
            lines = re.sub(r"\\\n\s*", " ", body).splitlines()
            for i, line in enumerate(lines):
                if not line.startswith("$ python -m mergeval"):
                    continue
                command = commands_in(line)[0]
                if not TINY.search(command) or "/tmp/" in command:
                    continue  # a recorded run on the reader's own models or files
                printed = []
                for later in lines[i + 1 :]:
                    if later.startswith("$ "):
                        break
                    printed.append(later)
                errors = [p for p in printed if p.startswith("mergeval: error:")]
                shown.append(Shown(page, "error" if errors else "ok", command, errors))
    return shown, orphans


def readme_commands() -> list[Shown]:
    """The README's commands beyond the two: run where they only read or print, composed where they would run a
    model (its tiny and own-models commands are the pages', run above)."""
    shown = []
    rest = README.read_text().split("## Two commands", 1)[1].split("\n## ", 1)[1]
    for lang, body in fenced(rest):
        for c in commands_in(body) if lang == "bash" else []:
            if any(p in c for p in PLACEHOLDERS) or re.search(r"(^| )-m( |$)", c.split(" ", 3)[-1]):
                continue
            if cheap(c):
                shown.append(Shown("README.md", "ok", c))
            elif module_of(c) in HYDRA_MODULES:
                shown.append(Shown("README.md", "compose", c))
    return shown


SHOWN, ORPHANS = shown_commands()
SHOWN = readme_commands() + SHOWN


def test_every_tiny_command_the_pages_show_is_run():
    assert not ORPHANS, (
        f"tiny commands in a block with commands the test cannot run; give them a block of their own: {ORPHANS}"
    )
    kinds = {s.kind for s in SHOWN}
    assert {"block", "error", "compose"} <= kinds, kinds
    scripts = "\n".join(s.text for s in SHOWN)
    for expected in (
        "python -m mergeval +experiment=tiny",
        "python -m mergeval.staged +experiment=tiny_staged",
        "python -m mergeval.search +experiment=tiny",
        "mergeval.report multirun/",
        "mergekit=mk/mergekit.yaml",
        "python -m mergeval.verify --all --strict",
        "hydra/sweeper=staged +experiment=tiny",
        "results import lmout",
    ):
        assert expected in scripts, expected


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, cache) -> Path:
    """The reader's working directory, shared by the commands in page order; with ``myconf/modelset/mine.yaml``
    of "Your own models" pointing at the tiny zoo's base and experts."""
    where = tmp_path_factory.mktemp("reader")
    done = run_module(
        "mergeval",
        "+experiment=tiny",
        "hydra.run.dir=tiny-models",
        cwd=where,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    models = {m["role"]: m["path"] for m in json.loads((where / "tiny-models" / "result.json").read_text())["models"]}
    page = (DOCS / "getting-started" / "your-models.md").read_text()
    text = (
        own_models_yaml(page)
        .replace("/models/base", models["base"])
        .replace("/models/math", models["chem"])
        .replace("/models/code", models["units"])
    )
    (where / "myconf" / "modelset").mkdir(parents=True)
    (where / "myconf" / "modelset" / "mine.yaml").write_text(text)
    return where


def own_models_yaml(page: str) -> str:
    return next(body for lang, body in fenced(page) if lang == "yaml" and "myconf/modelset/mine.yaml" in body)


def own_models_command(page: str) -> str:
    return next(
        line
        for lang, body in fenced(page)
        if lang == "bash"
        for line in body.splitlines()
        if line.startswith("python -m mergeval --config-dir myconf")
    )


def reader_env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.slow
@pytest.mark.parametrize("shown", SHOWN, ids=[s.id for s in SHOWN])
def test_a_command_the_pages_show_does_what_they_say(shown, workdir):
    if shown.kind == "block":
        done = subprocess.run(
            ["bash", "-e", "-c", shown.text], cwd=workdir, env=reader_env(), capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, (shown.page, shown.text, done.stdout[-2000:], done.stderr[-3000:])
        return
    args = shlex.split(shown.text)[3:]
    if shown.kind == "compose" and "--help" not in args:
        args += ["--cfg", "job"]
    done = run_module(module_of(shown.text), *args, cwd=workdir, env=reader_env(), timeout=900)
    if shown.kind == "error":
        assert done.returncode == 2, (shown.text, done.stderr[-3000:])
        assert done.stderr.strip().splitlines() == shown.expected, (shown.page, shown.text)
    else:
        assert done.returncode == 0, (shown.page, shown.text, done.stderr[-3000:])


@pytest.mark.slow
def test_your_own_models_merge_with_ties_and_score_on_hellaswag(workdir):
    """The getting-started recipe as printed, on the tiny zoo's checkpoints: it composes to TIES on hellaswag,
    and runs offline with hellaswag fed from the small file mergeval ships in its schema."""
    command = own_models_command((DOCS / "getting-started" / "your-models.md").read_text())
    args = shlex.split(command)[3:]
    done = run_module("mergeval", *args, "--cfg", "job", cwd=workdir, env=reader_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^  name: ties$", done.stdout, flags=re.M) and "- hellaswag" in done.stdout, done.stdout
    offline = [a for a in args if a != "offline=false"] + [
        "benchmark.data.hellaswag.validation=shipped:data/hellaswag/validation.jsonl",
        "benchmark.data.hellaswag.train=shipped:data/hellaswag/train.jsonl",
        "hydra.run.dir=own-models",
    ]
    done = run_module("mergeval", *offline, cwd=workdir, env=reader_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((workdir / "own-models" / "result.json").read_text())
    assert result["config"]["method"]["name"] == "ties" and result["tasks"] == ["hellaswag"]
    assert [m["role"] for m in result["models"]][:1] == ["base"] and len(result["models"]) == 4
