"""``python -m mergeval.check offline=false`` against a local stand-in for the Hugging Face hub (``HF_ENDPOINT``):
only the small metadata is read (file list with sizes, config.json / adapter_config.json), never a weight; the
download size is printed; each incompatible expert is one line; a missing repository is one line, no traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from mergeval.core.errors import UserError
from tests.child import run_module

COMMIT = "0123456789abcdef0123456789abcdef01234567"
WEIGHTS = (".safetensors", ".bin")


class Hub(ThreadingHTTPServer):
    """The hub's routes that ``model_info(files_metadata=True)`` and ``hf_hub_download`` use, for the repositories
    in ``repos`` (id -> file name -> bytes); ``gated`` ids list their files but refuse to serve them. Every path
    asked for is recorded in ``asked``."""

    daemon_threads = True

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: tuple[str, ...] = ()):
        super().__init__(("127.0.0.1", 0), _Answer)
        self.repos, self.gated, self.asked = repos, gated, []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Answer(BaseHTTPRequestHandler):
    server: Hub

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def log_message(self, *args) -> None:
        pass

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.server.asked.append(path)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
            files = self.server.repos.get(m[1])
            if files is None:
                return self._send(404, b'{"error":"Repository not found"}', body, {"X-Error-Code": "RepoNotFound"})
            siblings = [{"rfilename": name, "size": len(data), "blobId": _sha1(data)} for name, data in files.items()]
            doc = {"id": m[1], "modelId": m[1], "sha": COMMIT, "private": False, "siblings": siblings}
            return self._send(200, json.dumps(doc).encode(), body, {"Content-Type": "application/json"})
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path):
            repo, name = m[1], m[2]
            if repo in self.server.gated:
                return self._send(401, b"gated", body, {"X-Error-Code": "GatedRepo"})
            data = self.server.repos.get(repo, {}).get(name)
            if data is None:
                return self._send(404, b"not found", body, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
            return self._send(200, data, body, {"X-Repo-Commit": COMMIT, "ETag": f'"{_sha1(data)}"'})
        self._send(404, b"no such route", body, {})

    def _send(self, status: int, data: bytes, body: bool, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(len(data)), **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _repo(model_dir: Path, **config_changes) -> dict[str, bytes]:
    """A hub repository of ``model_dir``'s files, its config.json changed by ``config_changes``."""
    files = {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}
    config = json.loads(files["config.json"])
    files["config.json"] = json.dumps({**config, **config_changes}).encode()
    return {**files, "README.md": b"# a tiny model\n"}  # README.md: listed, but not what a run downloads


@pytest.fixture(scope="module")
def hub(tiny_dir):
    adapter = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "other/base",
    }
    config = json.loads((tiny_dir / "config.json").read_text())
    repos = {
        "tiny/base": _repo(tiny_dir),
        "tiny/chem": _repo(tiny_dir),
        "tiny/units": _repo(tiny_dir),
        "tiny/wide": _repo(tiny_dir, hidden_size=2 * config["hidden_size"]),
        "tiny/bigvocab": _repo(tiny_dir, vocab_size=config["vocab_size"] + 64),
        "tiny/gptq": _repo(tiny_dir, quantization_config={"quant_method": "gptq", "bits": 4}),
        "tiny/lora-other": {
            "adapter_config.json": json.dumps(adapter).encode(),
            "adapter_model.safetensors": b"\0" * 4096,
        },
        "tiny/pickled": {k: v for k, v in _repo(tiny_dir).items() if k != "model.safetensors"}
        | {"pytorch_model.bin": b"\0" * 4096},
        "tiny/gated": _repo(tiny_dir),
    }
    server = Hub(repos, gated=("tiny/gated",))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def hub_env(hub, tmp_path_factory, cache):
    """The check's environment: the stand-in hub, an empty Hugging Face cache, and HF_HUB_OFFLINE=1, which
    offline=false must override. One for the module, so the test children share one pre-imported zygote."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path_factory.mktemp("hf-home")), "HF_HUB_OFFLINE": "1"}


def _check(hub_env, cwd: Path, base: str, experts: dict[str, str], *extra: str):
    """``python -m mergeval.check offline=false`` on the tiny experiment with a modelset of these sources (a file
    of --config-dir: experts cannot be added on the command line); (the completed process, its
    ``mergeval: missing: modelset.*`` lines without that prefix)."""
    (cwd / "conf" / "modelset").mkdir(parents=True)
    (cwd / "conf" / "modelset" / "hub.yaml").write_text(
        json.dumps(
            {
                "defaults": ["modelset_schema", "_self_"],
                "name": "hub",
                "base": base,
                "experts": {name: {"source": source} for name, source in experts.items()},
            }
        )
    )
    out = run_module(
        "mergeval.check",
        "--config-dir",
        str(cwd / "conf"),
        "+experiment=tiny",
        "modelset=hub",
        "offline=false",
        *extra,
        cwd=cwd,
        env=hub_env,
        timeout=300,
    )
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "HTTP Request" not in out.stdout, out.stdout[-3000:]  # the hub client's request log stays quiet
    lines = [line.removeprefix("mergeval: missing: ") for line in out.stderr.splitlines()]
    assert all(line.startswith(("modelset.", "benchmark.")) for line in lines), out.stderr[-3000:]
    return out, [line for line in lines if line.startswith("modelset.")]


def _no_weights_asked(hub: Hub) -> None:
    assert hub.asked and not [p for p in hub.asked if p.endswith(WEIGHTS)], hub.asked


def test_compatible_hub_models_are_sized_and_fetched_from_their_metadata_alone(hub, hub_env, tmp_path):
    hub.asked.clear()
    out, lines = _check(hub_env, tmp_path, "hf:tiny/base", {"chem": "hf:tiny/chem", "units": "hf:tiny/units"})
    assert out.returncode == 2
    sizes = {name: len(data) for name, data in hub.repos["tiny/base"].items() if name != "README.md"}
    assert [line.split(":")[0] for line in lines] == [
        "modelset.base",
        "modelset.experts.chem",
        "modelset.experts.units",
    ], lines
    for line in lines:
        assert f"on the hub: {len(sizes)} files, " in line and "to download); fetch: hf download tiny/" in line, line
    total = re.search(r"to download from the hub: (.+?) \(3 models not yet local", out.stdout)
    assert total and total[1] == f"{3 * sum(sizes.values()) / 1024:.1f} KiB", out.stdout[-3000:]
    _no_weights_asked(hub)
    assert {"/api/models/tiny/base", f"/tiny/base/resolve/{COMMIT}/config.json"} <= set(hub.asked)
    assert not list(Path(hub_env["HF_HOME"]).rglob("config.json"))  # the cache is left as it was


@pytest.mark.parametrize("vocab_policy", ["error", "base"])
def test_each_incompatible_expert_is_one_line_naming_it(hub, hub_env, tmp_path, vocab_policy):
    hub.asked.clear()
    experts = {
        "chem": "hf:tiny/chem",
        "wide": "hf:tiny/wide",
        "lora": "hf:tiny/lora-other",
        "vocab": "hf:tiny/bigvocab",
        "gptq": "hf:tiny/gptq",
        "pickled": "hf:tiny/pickled",
    }
    out, lines = _check(hub_env, tmp_path, "hf:tiny/base", experts, f"vocab_policy={vocab_policy}")
    assert out.returncode == 2
    fetch = [line.split(":")[0] for line in lines if "; fetch: hf download" in line]
    assert fetch == [
        "modelset.base",
        "modelset.experts.chem",
        "modelset.experts.wide",
        "modelset.experts.lora",
        "modelset.experts.vocab",
    ], lines
    others = [line for line in lines if "; fetch: hf download" not in line]
    want = [
        r"modelset\.experts\.gptq: hf:tiny/gptq \(on the hub: .*quantized \(gptq, 4-bit\), which mergeval "
        r"cannot dequantize\); fetch: use the unquantized checkpoint",
        r"modelset\.experts\.pickled: hf:tiny/pickled \(on the hub without \*\.safetensors weights \(only "
        r"pytorch_model\.bin",
        r"modelset\.experts\.wide: hidden_size is 64 but the base has 32; merge only models of the base's",
        r"modelset\.experts\.lora: is a LoRA adapter for other/base, not for the modelset's base hf:tiny/base; "
        r"set modelset\.base to other/base",
    ]
    if vocab_policy == "error":
        want.append(
            r"modelset\.experts\.vocab: vocabulary differs from the base: vocab_size 448 vs 384; merge "
            r"models that share the base's tokenizer, or set vocab_policy=base"
        )
    else:
        assert "note: modelset.experts.vocab: vocab_size 448 vs the base's 384" in out.stdout, out.stdout[-3000:]
    assert len(others) == len(want) and all(re.match(w, line) for w, line in zip(want, others)), others
    _no_weights_asked(hub)


def test_a_local_base_is_compared_with_a_hub_expert(hub, hub_env, tmp_path, tiny_dir):
    out, lines = _check(hub_env, tmp_path, str(tiny_dir), {"chem": "hf:tiny/chem", "wide": "hf:tiny/wide"})
    assert out.returncode == 2
    assert [line.split(";")[0] for line in lines if "fetch: hf download" not in line] == [
        "modelset.experts.wide: hidden_size is 64 but the base has 32"
    ], lines
    assert "to download from the hub:" in out.stdout and "(2 models not yet local" in out.stdout


def test_a_repository_the_hub_does_not_have_is_one_clear_line(hub, hub_env, tmp_path):
    out, lines = _check(hub_env, tmp_path, "hf:tiny/base", {"ghost": "hf:nobody/nothing"})
    assert out.returncode == 2
    ghost = [line for line in lines if line.startswith("modelset.experts.ghost")]
    assert ghost == [
        f"modelset.experts.ghost: hf:nobody/nothing (no repository nobody/nothing on the hub at "
        f"{hub.url} (or it is private)); fetch: check the id (hf:<org>/<name>); for a private "
        "repository log in (hf auth login) or set HF_TOKEN"
    ], lines


def test_offline_true_asks_the_hub_nothing(hub, hub_env, tmp_path):
    hub.asked.clear()
    out = run_module(
        "mergeval.check", "+experiment=tiny", "modelset.base=hf:tiny/base", cwd=tmp_path, env=hub_env, timeout=300
    )
    assert out.returncode == 2 and hub.asked == []
    assert "modelset.base: hf:tiny/base (not in the local Hugging Face cache); fetch: hf download" in out.stderr


@pytest.fixture
def in_process_hub(hub, monkeypatch):
    """The hub client of this process pointed at the stand-in (it read HF_ENDPOINT when imported)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.asked.clear()
    return hub


def test_hub_model_reads_the_file_list_and_the_configs_only(in_process_hub):
    from mergeval.models.hub_metadata import hub_model

    files = in_process_hub.repos["tiny/gptq"]
    model = hub_model("tiny/gptq", "modelset.experts.x")
    assert model.commit == COMMIT and model.files == {name: len(data) for name, data in files.items()}
    assert set(model.download) == set(files) - {"README.md"}
    assert model.download_size == sum(len(data) for name, data in files.items() if name != "README.md")
    assert model.config == json.loads(files["config.json"]) and model.quantization["quant_method"] == "gptq"
    assert not model.is_adapter and model.adapter_base is None
    adapter = hub_model("tiny/lora-other", "modelset.experts.x")
    assert adapter.is_adapter and adapter.adapter_base == "other/base" and adapter.config is None
    asked = [path for path in in_process_hub.asked if path != "/api/agent-harnesses"]  # the client's own telemetry
    assert asked == [
        "/api/models/tiny/gptq",
        f"/tiny/gptq/resolve/{COMMIT}/config.json",
        f"/tiny/gptq/resolve/{COMMIT}/config.json",
        "/api/models/tiny/lora-other",
        f"/tiny/lora-other/resolve/{COMMIT}/adapter_config.json",
        f"/tiny/lora-other/resolve/{COMMIT}/adapter_config.json",
    ]  # HEAD, then GET


def test_a_gated_repository_and_an_unreachable_hub_are_user_errors(in_process_hub, monkeypatch):
    from huggingface_hub import constants

    from mergeval.models.hub_metadata import hub_model

    with pytest.raises(UserError) as gated:
        hub_model("tiny/gated", "modelset.base")
    assert str(gated.value).startswith("modelset.base: tiny/gated is gated on the hub; accept its conditions")
    down = "http://127.0.0.1:9"  # the discard port: nothing listens
    monkeypatch.setattr(constants, "ENDPOINT", down)
    with pytest.raises(UserError) as unreachable:
        hub_model("tiny/base", "modelset.base")
    assert str(unreachable.value).startswith(f"modelset.base: cannot reach the hub at {down} for tiny/base (")
