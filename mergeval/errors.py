"""The one exception type for mistakes a user can fix.

A ``UserError`` names the config field (or input) at fault and the fix; the
entry point prints it as one line and exits with status 2, without a traceback.
Anything else that escapes is a bug in mergeval and keeps its traceback.
"""

from __future__ import annotations

import re


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
    "ENOSPC": ("no space left on the device", "free some space there, or choose another location "
               "(cache_dir=..., output=..., store.path=...)"),
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
