"""Where mergeval keeps what it builds (converted models, experts, generated tasks)."""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

from platformdirs import user_cache_dir

from mergeval.core.proc import orphaned, tmp_prefix


def cache_root(cache_dir: str | None) -> Path:
    """``cache_dir`` from the config, else $MERGEVAL_CACHE, else the user cache dir."""
    root = cache_dir or os.environ.get("MERGEVAL_CACHE") or user_cache_dir("mergeval")
    path = Path(root).expanduser().resolve()
    try:
        make_dirs(path)
    except OSError as err:  # the line names the setting that chose the place, not only the place
        from mergeval.core.errors import UserError, from_os_error

        known = from_os_error(err)
        if known is None:
            raise
        field = "$MERGEVAL_CACHE" if not cache_dir and os.environ.get("MERGEVAL_CACHE") else "cache_dir"
        raise UserError(
            field, f"'{known.field}' {known.problem}", f"{known.fix} (cache_dir=DIR or $MERGEVAL_CACHE)"
        ) from None
    return path


def result_files_below(directory: Path) -> list[Path]:
    """Every result.json below ``directory`` in job order: a sweep's job directories 0, 1, ..., 9, 10, ...
    sorted as numbers (as strings, job 10 would come before job 2 and a run's index would depend on the
    sweep's size)."""

    def key(path: Path) -> list:
        return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.relative_to(directory).parts]

    return sorted(directory.rglob("result.json"), key=key)


@contextmanager
def atomic_dir(final: Path):
    """Yield a temporary sibling directory; rename it to ``final`` only if the block succeeds.

    A failed or interrupted build leaves no half-written ``final``: the temporary
    directory is removed on any exception (SIGTERM and Ctrl-C included); after a
    SIGKILL the next atomic write into the same parent removes it (its name
    proves its owner is gone, see ``mergeval.core.proc``).
    """
    make_dirs(final.parent)
    remove_orphans(final.parent)
    prefix = tmp_prefix(final.name)  # carries this process's identity: only our own directories match it
    try:  # from the directory's creation on: an interrupt right after mkdtemp must not leave it behind
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it owner-only; the result is an ordinary directory
        yield tmp
        if final.exists():  # built concurrently by another process: keep theirs
            shutil.rmtree(tmp)
        else:
            try:
                os.replace(tmp, final)
            except OSError as err:  # another builder renamed theirs between our check and our rename
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.is_dir():
                    raise
                shutil.rmtree(tmp)
            fsync_dir(final.parent)
    except BaseException as err:
        for ours in final.parent.glob(glob.escape(prefix) + "*"):  # ``tmp`` may not be bound yet
            shutil.rmtree(ours, ignore_errors=True)
        _name_the_place(err, final)
        raise


@contextmanager
def one_builder(final: Path, what: str):
    """Build ``final`` in one process at a time: yields True when this process should build it, False when
    another process built it while this one waited.

    Two sweep jobs (or test workers) that need the same expert used to train it twice, each keeping the CPU
    busy for minutes to throw one copy away; now the second waits for the first and reuses its copy. The
    lock is an ``flock`` on a hidden file beside ``final`` (``.<name>.lock``, left in place: empty); the
    kernel releases it when its holder exits, however it ends, so a killed builder never blocks the next.
    Where the filesystem has no locks the build goes ahead unlocked, and ``atomic_dir`` still keeps one
    valid copy."""
    make_dirs(final.parent)
    try:
        handle = open(final.parent / f".{final.name}.lock", "a")
    except OSError:  # a read-only or full cache: no lock; the build's atomic_dir names the place if it fails
        handle = None
    with handle or nullcontext():
        if handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"mergeval: waiting for another process building {what}", flush=True)
                fcntl.flock(handle, fcntl.LOCK_EX)
            except OSError:  # no locks on this filesystem (some network mounts): build unlocked
                pass
        yield not final.exists()


def _name_the_place(err: BaseException, target: Path) -> None:
    """A write that failed without naming its file (a full disk, a file-size limit) names what was being
    written, so the one-line error says where (also when a native library wrapped it: errors.os_error_in)."""
    from mergeval.core.errors import os_error_in

    os_error = os_error_in(err)
    if os_error is not None and os_error.filename is None:
        raise OSError(os_error.errno, os_error.strerror, str(target)) from err


def make_dirs(directory: Path) -> None:
    """``mkdir -p``, with the OSError naming the first path in the way (an existing file, a read-only parent)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:  # a file where a directory should be, here or above
        blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), directory)
        raise NotADirectoryError(errno.ENOTDIR, "is a file, not a directory", str(blocker)) from err


def check_creatable(final: Path) -> None:
    """Raise an OSError naming the place unless the directory ``final`` could be created later: its nearest
    existing ancestor must be a directory in which this process can make an entry. Tried by making and
    removing an empty temporary directory there, because permission bits do not tell (root ignores them, and
    /proc refuses every mkdir with ENOENT); nothing is left behind, not even ``final``'s missing parents."""
    ancestor = next(p for p in final.parents if p.exists())  # "/" always exists
    if not ancestor.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "is a file, not a directory", str(ancestor))
    try:
        # its own name: not the build's temporary directory (which tells a watcher the build has begun)
        os.rmdir(tempfile.mkdtemp(prefix=tmp_prefix(f"{final.name}.probe"), dir=ancestor))
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(ancestor)) from None


def remove_orphans(directory: Path) -> list[str]:
    """Remove the temporary files and directories in ``directory`` left by mergeval processes that were killed
    (SIGKILL, power loss) on this host; returns their names. Entries of live processes are never touched."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(".tmp-") and orphaned(entry.name):
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(entry.name)
            except OSError:  # another process removed it first, or it is not ours to remove
                pass
    return removed


def dir_size(path: Path) -> int:
    """Bytes of the files below ``path``, symlinks followed once (a Hugging Face cache snapshot links to blobs)."""
    return sum(p.resolve().stat().st_size for p in path.rglob("*") if p.resolve().is_file())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all, and durably: the data is fsynced before the rename and the directory
    after it, so a crash or power loss leaves the old file or the new one, never a torn or empty one."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``atomic_write_text`` for bytes."""
    make_dirs(path.parent)
    remove_orphans(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix(path.name), dir=path.parent)
    try:
        # mkstemp makes the file owner-only; the result is an ordinary file, as open() would make it (result.json
        # and mergekit.yaml were 0600 beside a run's other 0644 files)
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        _name_the_place(err, path)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Persist a rename inside ``directory`` (POSIX needs the directory itself fsynced)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
