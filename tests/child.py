"""``python -m <module> <args>`` as a child process, without paying the libraries' imports every time.

Most tests run mergeval's command lines in a child process, as a user would, and each child spent its first
seconds importing torch, transformers, datasets and lm-eval (``-X importtime``: 8.7 s for a tiny run's child
while the suite ran beside it; the suite's worker time fell from 2537 s to 1604 s with the zygote, 2026-12-03).
``run_module`` starts the child by forking a *zygote* instead: a process per pytest
worker that imported those libraries once and then waits. The forked child does what ``python -m`` does (the
working directory, the environment, ``sys.argv``, ``sys.path[0]``, runpy's ``_run_module_as_main``) and ends as
a fresh interpreter would (its exit status, an uncaught exception's traceback, atexit handlers), with its own
stdout and stderr.

A fresh ``python -m`` runs instead, with nothing else changed, when
- the child's environment differs from every running zygote's in a variable that the pre-imported libraries
  read when imported (``IMPORT_TIME_VARS``; the worker then starts a zygote for it, at most ``POOL`` of them),
- ``MERGEVAL_TEST_FORK=0`` (every child of the suite is then a fresh interpreter),
- the zygote would not serve: importing torch with more than one OpenMP thread per process starts threads,
  and a process with threads must not fork, so only workers with ``OMP_NUM_THREADS=1`` get one (the suite's
  two workers on two cores, as in CI; ``-n 0`` or more cores per worker run every child fresh), or
- the zygote died.
What a forked child shares with its zygote and tests must not rely on: the modules already imported (none of
mergeval's), the hash seed and numpy's legacy global random state.

Run as a script, this module is the zygote: requests are JSON lines on stdin, replies (the child's pid, then
its exit status) lines on stdout.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# What the zygote imports before it forks: the costly part of every child's start (transformers' Llama model
# and tokenizer modules are what a run loads; they are imported lazily otherwise; numba is what the merge engine's
# compiled kernels import, mergeval/methods/fused.py). Not datasets or
# lm_eval.evaluator: they import pyarrow, whose allocator starts a thread, and a process with threads must not fork.
PRELOAD = (
    "torch",
    "numpy",
    "safetensors.torch",
    "omegaconf",
    "hydra",
    "hydra.utils",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.auto.tokenization_auto",
    "lm_eval.api.model",
    "numba",
)
# Environment variables those libraries (or the C runtimes under them) read when imported: a child whose values
# differ gets a zygote started with its own.
IMPORT_TIME_PREFIXES = (
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "DATASETS",
    "TOKENIZERS",
    "TORCH",
    "PYTORCH",
    "NUMBA",
    "OMP_",
    "MKL_",
    "KMP_",
    "CUDA",
    "NVIDIA",
    "LD_",
    "PYTHON",
    "XDG_",
    "TQDM",
    "LC_",
)
IMPORT_TIME_VARS = ("HOME", "LANG", "LOGLEVEL", "TMPDIR")
POOL = 3


def import_time_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) or k in IMPORT_TIME_VARS))


class Zygote:
    """One pre-imported interpreter waiting to fork children, for one environment."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.pending = bytearray()
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd="/",
        )
        try:
            self.ready = self._line(timeout=600) == "ready"
        except EOFError:  # it refused to serve (threads after its imports) or could not import
            self.ready = False
        if not self.ready:
            self.close()

    def _line(self, timeout: float | None) -> str | None:
        """One reply line, or None when ``timeout`` passed; EOFError when the zygote has ended. Read unbuffered,
        so a second line already sent is not hidden from ``select`` in a buffer."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if timeout is not None and not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError("the zygote has ended")
            self.pending += chunk
        line, _, rest = bytes(self.pending).partition(b"\n")
        self.pending[:] = rest
        return line.decode().strip()

    def run(
        self, module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float | None
    ) -> subprocess.CompletedProcess | None:
        """The child's result, or None if this zygote could not run it (the caller then spawns a fresh one)."""
        with tempfile.TemporaryDirectory(prefix="mergeval-child-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {
                "module": module,
                "args": args,
                "cwd": str(cwd),
                "env": env,
                "stdout": str(out),
                "stderr": str(err),
            }
            try:
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
                pid = self._line(timeout=60)
            except (OSError, EOFError):  # it died before forking: the child never started
                pid = None
            if pid is None:
                self.close()
                return None
            status = self._line(timeout)  # EOFError here (the zygote died while the child ran) fails the test
            if status is None:  # the timeout passed: end the child as subprocess.run would
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._line(timeout=60)
                raise subprocess.TimeoutExpired(
                    [sys.executable, "-m", module, *args], timeout, out.read_bytes(), err.read_bytes()
                )
            return subprocess.CompletedProcess(
                [sys.executable, "-m", module, *args],
                int(status),
                out.read_text(errors="replace"),
                err.read_text(errors="replace"),
            )

    def alive(self) -> bool:
        return self.ready and self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_zygotes: dict[tuple, Zygote] = {}
_refused: set[tuple] = set()  # environments whose zygote would not serve (e.g. torch started threads): not retried
_lock = threading.Lock()  # one child at a time per zygote: tests that need concurrent children use Popen


def _zygote_for(env: dict[str, str]) -> Zygote | None:
    key = import_time_env(env)
    if key in _refused:
        return None
    zygote = _zygotes.get(key)
    if zygote is not None and zygote.alive():
        return zygote
    if zygote is not None:
        del _zygotes[key]
    if len(_zygotes) >= POOL:
        _zygotes.pop(next(iter(_zygotes))).close()  # the oldest
    zygote = Zygote(env)
    if not zygote.ready:
        _refused.add(key)
        return None
    _zygotes[key] = zygote
    return zygote


def run_module(
    module: str, *args: str, cwd: Path | str, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)``, by forking a pre-imported zygote where it can (the module docstring)."""
    env = dict(os.environ if env is None else env)
    if os.environ.get("MERGEVAL_TEST_FORK", "1") != "0":
        with _lock:
            zygote = _zygote_for(env)
            done = zygote.run(module, list(args), Path(cwd).resolve(), env, timeout) if zygote else None
        if done is not None:
            return done
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def default_signals() -> None:
    """A ``preexec_fn`` for a child that is sent signals: it gets SIGINT's and SIGTERM's default actions back. A
    suite started in the background (``cmd &``) runs with SIGINT ignored, which children inherit and Python then
    leaves ignored (as it should for a real background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def close_all() -> None:
    for zygote in _zygotes.values():
        zygote.close()
    _zygotes.clear()


# ---------------------------------------------------------------- the zygote


def _read_line(fd: int, pending: bytearray) -> bytes | None:
    """One line from ``fd`` read with os.read, so nothing is left in a buffer a forked child would inherit."""
    while b"\n" not in pending:
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return line


def _become(request: dict) -> None:
    """In the forked child: set up what ``python -m`` would have, then run the module as ``__main__``."""
    import runpy
    import types

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first
    sys.argv = [request["module"], *request["args"]]  # runpy replaces argv[0] with the module's file, as -m does
    sys.modules["__main__"] = types.ModuleType("__main__")  # a clean namespace, not this script's
    runpy._run_module_as_main(request["module"])


def _serve() -> None:
    for name in PRELOAD:
        __import__(name)
    # Forking is safe only while this process has a single thread (a forked child gets no copy of the others,
    # and a lock one of them held stays held): refuse to serve otherwise, and the caller spawns fresh children.
    tasks = Path("/proc/self/task")
    if threading.active_count() != 1 or (tasks.is_dir() and len(list(tasks.iterdir())) != 1):
        return
    # The imported modules' objects go to the collector's permanent generation: a child's collections (and its
    # exit) then skip them instead of touching, and so copying, every page the zygote holds (gc.freeze's purpose).
    gc.freeze()
    os.write(1, b"ready\n")
    pending = bytearray()
    while (line := _read_line(0, pending)) is not None:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _become(request)
            sys.exit(0)  # the module returned: exit as the interpreter would (atexit handlers, flushed output)
        os.write(1, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(1, f"{os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    _serve()
