"""The one exception type for mistakes a user can fix.

A ``UserError`` names the config field (or input) at fault and the fix; the
entry point prints it as one line and exits with status 2, without a traceback.
Anything else that escapes is a bug in mergeval and keeps its traceback.
"""

from __future__ import annotations

import re
from pathlib import Path


class UserError(Exception):
    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(f"{field}: {problem}; {fix}")

    def line(self) -> str:
        return f"mergeval: error: {self}"


# What the environment can do to a run (errno -> the problem in words and the fix). Any other OSError is
# unexpected and keeps its traceback.
_ENVIRONMENT = {
    "EACCES": ("permission denied", "make it writable/readable for this user, or choose another location"),
    "EPERM": ("operation not permitted", "make it writable for this user, or choose another location"),
    "EROFS": ("the file system is read-only", "choose a location on a writable file system"),
    "ENOSPC": (
        "no space left on the device",
        "free some space there, or choose another location (cache_dir=..., output=..., store.path=...)",
    ),
    "EDQUOT": ("the disk quota is exhausted", "free some space, or choose another location"),
    "EFBIG": ("the file grew past the file-size limit", "raise the limit (ulimit -f) or write elsewhere"),
    "ENOTDIR": ("is a file, not a directory", "remove that file or choose another location"),
    "EISDIR": ("is a directory, not a file", "give the path of a file"),
    "EEXIST": ("already exists", "remove it or choose another location"),
    "ENAMETOOLONG": ("the path is too long", "choose a shorter path"),
    "ELOOP": ("too many symbolic links", "fix the symbolic links on that path"),
    "EIO": ("input/output error", "check the device (a failing disk or network file system?)"),
}


# A native library's own exception type around an operating-system error: safetensors' Rust writer raises
# SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)").
_NATIVE_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_in(err: BaseException) -> OSError | None:
    """``err`` if it is an OSError; the OSError a native library reported inside its own exception type
    (module comment); else None."""
    if isinstance(err, OSError):
        return err
    found = _NATIVE_OS_ERROR.search(str(err)) if isinstance(err, Exception) else None
    if found is None:
        return None
    import os

    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def from_os_error(err: OSError) -> UserError | None:
    """The one-line error for an OSError the environment caused (read-only place, full disk, a file in the
    way...), naming the path; None for any other OSError."""
    import errno

    name = errno.errorcode.get(err.errno or 0, "")
    if name not in _ENVIRONMENT or err.filename is None:
        if name in ("ENOSPC", "EDQUOT", "EFBIG", "EROFS", "EIO"):  # a write without a path still says what
            return UserError("disk", _ENVIRONMENT[name][0], _ENVIRONMENT[name][1])
        return None
    import os

    problem, fix = _ENVIRONMENT[name]
    return UserError(os.path.abspath(os.fsdecode(err.filename)), problem, fix)


UTF8_FIX = "use a name that is valid UTF-8 (rename the file or directory, or link to it from such a path)"


def shown(text: str) -> str:
    """``text`` printable, bytes that are not UTF-8 written as \\xNN (as the OS gave them)."""
    import os

    return os.fsencode(text).decode("utf-8", "backslashreplace")


def is_utf8(text: str) -> bool:
    """Whether ``text`` (a path or value as Python decoded it from the OS) stands for valid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def nested_options(message: str, group: str) -> list[str]:
    """The options in subfolders of ``group`` (``method=mergebench/ties``: a paper's presets) on the config search
    path a Hydra message lists (``pkg://`` and ``file://`` entries); Hydra lists only the group's own files."""
    import importlib.resources
    from pathlib import Path

    found = []
    for kind, where in re.findall(r"provider=[^,]+, path=(pkg|file)://(\S+)", message):
        try:
            root = Path(str(importlib.resources.files(where))) if kind == "pkg" else Path(where)
        except (ImportError, TypeError, ValueError):  # a search path entry that is not there: nothing to list
            continue
        folder = root / group
        if folder.is_dir():
            found += [p.relative_to(folder).with_suffix("").as_posix() for p in folder.glob("*/**/*.yaml")]
    return found


def explain(ex: BaseException) -> str | None:
    """One line for a Hydra/OmegaConf composition error, or None if it is not one."""
    import yaml
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    chain: list[BaseException] = []
    cur: BaseException | None = ex
    while cur is not None:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    # An error inside an overridden value (e.g. a rule in method.rules) names its key relative to that value.
    target = next((m.group(1) for e in chain if (m := re.search(r"Could not override '([^']+)'", str(e)))), None)
    for err in chain:
        key = getattr(err, "full_key", None)
        if key and target and not str(key).startswith(target) and not target.startswith(f"{key}."):
            key = f"{target}[...].{key}"  # not where the override points, nor above it (a misspelt group)
        if isinstance(err, OmegaConfBaseException) and key:
            msg = str(err).splitlines()[0]
            if "not in" in msg or "is not in struct" in msg:
                return f"{key}: no such field; check the spelling (see conf/ for the fields of each group)"
            entry = re.match(r"Invalid type assigned: dict is not a subclass of (\w+)", msg)
            added = next(
                (
                    m.group(1).lstrip("+~")
                    for e in chain
                    if (m := re.search(r"Error merging override ([^=\s]+)=", str(e)))
                ),
                None,
            )
            if entry and added:  # a new key of metric.groups or modelset.experts, whose values are dataclasses
                return (
                    f"{added}: a new {entry.group(1)} cannot be added from the command line (OmegaConf "
                    "keeps the value a plain mapping there); write it in a config file: a file of "
                    f"conf/{added.split('.')[0]}/ or an experiment (yours with --config-dir)"
                )
            return f"{key}: {msg}; fix the value's type"
    bad_yaml = next((e for e in chain if isinstance(e, yaml.YAMLError)), None)
    if bad_yaml is not None:  # a config file of the user's (--config-dir, an experiment file) that YAML cannot read
        mark = getattr(bad_yaml, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark else "a config file"
        problem = getattr(bad_yaml, "problem", None) or str(bad_yaml).splitlines()[0]
        return f"{where}: not valid YAML ({problem}); fix the file's syntax there"
    if isinstance(ex, MissingConfigException):
        text = str(ex)
        found = re.search(r"Could not find '([^']+)/([^/']+)'", text)
        listed = re.search(r"Available options in '([^']+)'", text)
        options = re.findall(r"^\t(\S+)$", text.split("Config search path:")[0], flags=re.M)
        if found and listed and found.group(1).startswith(listed.group(1)):  # method=<paper>/<preset> too
            group = listed.group(1)
            name = f"{found.group(1)}/{found.group(2)}".removeprefix(group + "/")
            options = sorted(set(options) | set(nested_options(text, group)))
        elif found:
            group, name = found.groups()
        else:
            return text.splitlines()[0]
        options = [o for o in options if not o.endswith("_schema")]
        return f"{group}: unknown option '{name}'; choose one of: {', '.join(options) or '(none)'}"
    # A submitit (Slurm) job that ended with mergeval's one-line error: submitit's report quotes its stderr.
    if type(ex).__name__ in ("UncompletedJobError", "FailedJobError"):
        reported = re.findall(r"^mergeval: error: (.*)$", str(ex), flags=re.M)
        if reported:
            return reported[-1]
    shape = re.search(
        r"In '([^']+)': ValidationError.*?Invalid type assigned: (\w+) is not a subclass of (\w+)", str(ex), flags=re.S
    )
    if shape:  # a config file of the user's whose top level is not a mapping of the group's fields
        where, got, schema = shape.groups()
        return (
            f"{where}: the file holds a {got}, where the fields of a {schema} belong; write it as "
            f"'field: value' lines (see conf/{where.split('/')[0]}/ for examples)"
        )
    logging_setup = next(
        (
            m
            for e in chain
            if isinstance(e, ValueError)
            and (m := re.match(r"Unable to configure (handler|formatter|filter|root logger)(?: '([^']+)')?", str(e)))
        ),
        None,
    )
    if logging_setup:  # logging.config could not build what hydra.job_logging / hydra_logging describes
        kind, name = logging_setup.groups()
        node = "job_logging" if hydra_job_dir(ex.__traceback__)[0] is not None else "hydra_logging"
        cause = next((e for e in chain[chain.index(next(e for e in chain if isinstance(e, ValueError))) + 1 :]), None)
        why = f" ({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})" if cause else ""
        where = f"hydra.{node}.{kind}s.{name}" if name else f"hydra.{node}.root"
        return (
            f"{where}: logging cannot set it up{why}; fix its settings, or drop the "
            f"override to keep Hydra's default logging"
        )
    lexer = re.match(r"LexerNoViableAltException: (.*?)\s*$", str(ex).splitlines()[0] if str(ex) else "")
    if isinstance(ex, HydraException) and lexer:  # an override the grammar cannot read (space, quote, bad byte)
        arg = lexer.group(1).removesuffix("^").rstrip("; ")
        key = arg.split("=", 1)[0].lstrip("+~") or arg
        if any("\udc80" <= ch <= "\udcff" for ch in arg):  # bytes that are not UTF-8, as Python decodes argv
            return f"{shown(key)}: the value has bytes that are not UTF-8 text ({shown(arg)}); {UTF8_FIX}"
        return (
            f"{key}: Hydra's override grammar cannot read the value ({arg}); quote it for Hydra inside the "
            f"shell's quotes, e.g. \"{key}='...'\" (a ' inside: use \\' or the other quote)"
        )
    if isinstance(ex, ValueError) and str(ex).startswith("Only one of --run, --multirun, --cfg"):  # Hydra's own
        return (
            "-m/--multirun, --cfg, --info: only one of them at a time; drop the others (--cfg job shows one "
            "job's config: give it the sweep's first values without -m)"
        )
    if isinstance(ex, HydraException):
        lines = [ln.strip() for ln in str(ex).splitlines() if ln.strip() and not ln.startswith("See https")]
        key = next((ln.removeprefix("full_key:").strip() for ln in lines if ln.startswith("full_key:")), None)
        lines = [ln for ln in lines if not ln.startswith("full_key:")]
        text = ""  # a sentence wrapped over lines (Hydra's instantiation blocklist) stays one sentence
        for ln in lines:
            text += ln if not text else (" " if text[-1] not in ".:;!?" else "; ") + ln
        if re.search(r"Target '[^']+' is blocklisted", text):
            return f"{key or '_target_'}: {text.rstrip('.')}; use another _target_ (or none)"
        return f"{key}: {text}" if key else "; ".join(lines[:2])
    return None


def hydra_job_dir(tb) -> tuple[Path | None, bool]:
    """(the job directory Hydra's ``run_job`` was setting up when the traceback ``tb`` was raised, whether it is
    a sweep's job: run_job is given a sub-directory key), or (None, False)."""
    found, swept = None, False
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "run_job" and frame.f_globals.get("__name__") == "hydra.core.utils":
            found = frame.f_locals.get("output_dir", found)
            swept = frame.f_locals.get("job_subdir_key") is not None
        tb = tb.tb_next
    return (Path(found).absolute(), swept) if isinstance(found, str) else (None, False)
