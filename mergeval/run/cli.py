"""The command-line contract shared by every entry point (run, merge, staged).

Mistakes a user can make (a bad override, an unknown option, an invalid
hyperparameter, a missing or damaged model) and faults of the environment (a
read-only place, a full disk, a damaged results store) end in one line on
stderr and exit status 2, and a job that failed that way leaves no job
directory behind. SIGTERM is handled like Ctrl-C: the work stops, temporary
files are removed, the run is recorded as ``interrupted``, one line, exit 2,
and the process ends at once (``end_now``).
A multirun (``-m``) composes and checks every job's config before the first
job starts. Set HYDRA_FULL_ERROR=1 to see the full traceback instead. A command's
exit skips the interpreter's last garbage collection (``skip_final_collection``), the one process-level
shortcut kept: it saves more than a twentieth of a 1.1B-parameter merge (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from mergeval.core.errors import UserError, explain, from_os_error, hydra_job_dir, os_error_in


def discard_job_dir(job_dir: Path) -> None:
    """A run that failed on bad input leaves no job directory, if it holds only Hydra's own files
    (never a directory with anything else in it, e.g. when hydra.run.dir points at the working directory)."""
    import shutil

    if job_dir.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in job_dir.iterdir()):
        shutil.rmtree(job_dir, ignore_errors=True)
        for parent in (job_dir.parent, job_dir.parent.parent):  # outputs/<date>/ and outputs/, if now empty
            try:
                parent.rmdir()
            except OSError:  # not empty (other runs) or not ours to remove
                break


def discard_abandoned_job_dirs(job_dir: Path) -> None:
    """Remove the job directories beside ``job_dir`` that a killed mergeval process left: only Hydra's files and
    the temporary directory of a write that never finished, whose owner is proven gone (``proc.orphaned``: a
    SIGKILLed ``mergeval.merge`` left ``.hydra``, its log and ``.tmp-...merged_model`` behind). A directory
    without such proof may belong to a job still running (fine-tuning experts, say) and is left alone."""
    import shutil

    from mergeval.core.proc import orphaned

    try:
        siblings = [p for p in job_dir.parent.iterdir() if p.is_dir() and p != job_dir]
    except OSError:
        return
    for sibling in siblings:
        try:
            entries = list(sibling.iterdir())
        except OSError:
            continue
        temps = [p for p in entries if p.name.startswith(".tmp-")]
        hydra_only = all(p.name == ".hydra" or p.suffix == ".log" or p in temps for p in entries)
        if temps and hydra_only and all(orphaned(p.name) for p in temps):
            shutil.rmtree(sibling, ignore_errors=True)


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so every cleanup that handles one handles both."""


# The interruption (its signal) that this command has not yet reported, or None. From the first signal until
# ``run_cli`` reports it, the signal is sent again to the main thread every RESEND_S seconds, and its handler raises
# again wherever no interruption is already on its way up: native code can swallow the exception a handler raises
# (the suite saw a Ctrl-C raised inside numpy's extension-module import, under numba's, vanish, and the merge
# finished with status 0), as can a weakref callback or a finalizer. A command that returns with one unreported
# is reported as interrupted all the same (``_run_cli``).
_unreported: int | None = None
RESEND_S = 0.25


def _on_signal(signum, frame) -> None:
    """SIGTERM's and SIGINT's handler in a command: raise the interruption (``Interrupted`` or KeyboardInterrupt)
    unless one is already propagating here (its cleanup must not be cut short by a second one) or the handler
    runs inside importlib's own code (see ``_in_import_machinery``); the resender delivers it again then."""
    global _unreported
    if _unreported is None:
        _unreported = signum
        _start_resending()
    if _in_import_machinery(frame) or isinstance(sys.exc_info()[1], KeyboardInterrupt):
        return
    raise Interrupted("SIGTERM") if _unreported == signal.SIGTERM else KeyboardInterrupt


def _start_resending() -> None:
    import threading

    main = threading.main_thread().ident
    assert main is not None, "the main thread has started"

    def resend() -> None:
        while True:
            time.sleep(RESEND_S)
            signum = _unreported
            if signum is None:
                return
            signal.pthread_kill(main, signum)  # to the main thread itself: see _redeliver_later

    threading.Thread(target=resend, name="mergeval-interruption", daemon=True).start()


def interruption_reported() -> None:
    """The command has reported its interruption (or is ending without the interpreter's teardown): stop sending
    it again."""
    global _unreported
    _unreported = None


def _in_import_machinery(frame) -> bool:
    """Whether the signal's handler would raise inside importlib's own code. It must not: importlib takes the
    global import lock and releases it in a ``finally`` one statement later, and an exception raised between the
    two (its module-lock weakref callback does exactly this) leaves the lock held for good. A merge's worker
    threads then waited for it forever on their next import, and the interrupted merge with them (seen once in
    the suite: ``test_a_signal_mid_merge_stops_cleanly``, both workers in ``_get_module_lock``)."""
    return frame is not None and frame.f_code.co_filename.startswith("<frozen importlib")


def _redeliver_later(signum: int) -> None:
    """Send ``signum`` again in a moment, to the main thread itself. Sent to the process from another thread (as
    ``signal.raise_signal`` there does) it landed in that thread, and a main thread blocked in a wait (a lock, a
    future's result) was never woken to run the handler: the interrupted merge above waited forever."""
    import threading

    threading.Timer(0.05, signal.pthread_kill, (threading.main_thread().ident, signum)).start()


def _redeliver_swallowed_interrupt(unraisable) -> None:
    """``sys.unraisablehook``: Python discards an exception raised where nothing can catch it (a weakref
    callback, ``__del__``). A SIGTERM whose handler ran there was lost: the suite once saw it raised inside
    importlib's module-lock callback during an import, and the run went on to finish with status 0. In a
    command the resender sends it again (``_on_signal``); in a process with Python's own SIGINT handler (a
    sweep's worker, see ``failing_cleanly``) it is sent again from here. Anything else goes to Python's own
    hook. One raised while the interpreter waits for threads at exit ends the process at once, with status 2
    (below)."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        import threading

        if unraisable.object is threading:  # raised while the interpreter waited for threads at exit
            # Python would go on to its teardown with those threads still running, and one inside torch or numba
            # then aborts the process when it next takes the GIL ("terminate called without an active
            # exception", status -6, as a Ctrl-C or SIGTERM while a thread runs a matrix product at exit does).
            # The command is ending anyway: end it now, as an interruption.
            end_now(2)
        if _unreported is not None:
            return
        signum = signal.SIGTERM if isinstance(unraisable.exc_value, Interrupted) else signal.SIGINT
        # A moment later: sent from here, the handler would run inside this hook, where its exception would be
        # discarded again. If it lands in another such place, this runs once more.
        _redeliver_later(signum)
        return
    sys.__unraisablehook__(unraisable)


def handle_sigterm() -> None:
    """SIGTERM raises ``Interrupted`` (a KeyboardInterrupt) in the main thread; neither it nor Ctrl-C is lost
    on the way."""
    signal.signal(signal.SIGTERM, _on_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # Python's own: a KeyboardInterrupt
        signal.signal(signal.SIGINT, _on_signal)
    sys.unraisablehook = _redeliver_swallowed_interrupt


def user_failure(err: BaseException) -> UserError | None:
    """The one-line error for a failure the user or the environment caused, else None (a bug)."""
    if isinstance(err, UserError):
        return err
    os_error = os_error_in(err)  # a native library's full disk too (safetensors' SafetensorError)
    return None if os_error is None else from_os_error(os_error)


@contextmanager
def failing_cleanly(job_dir: Path):
    """Around a job's work: on a user's mistake, a fault of the environment or an interruption, the job
    directory goes if it holds only Hydra's own files. A failure ends the process here with its one line and
    status 2 (an exception escaping the job would make Hydra log its own report first); an interruption goes
    on to ``run_cli`` (Hydra lets BaseExceptions through unreported).

    A job in a worker process (joblib's launcher) runs here without ``run_cli``'s set-up, so the hook that sends
    a discarded interruption again is installed for the job's length: a Ctrl-C to a sweep's process group
    reaches its workers too, and one that landed in a finalizer there (regex's ``Group.__del__``) printed
    Python's five-line "Exception ignored" report before the sweep's one line, and left the job running."""
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _redeliver_swallowed_interrupt
    try:
        _check_job_dir_text(job_dir)
        discard_abandoned_job_dirs(job_dir)
        yield
    except KeyboardInterrupt:
        discard_job_dir(job_dir)
        raise
    except Exception as err:
        known = None if os.environ.get("MERGEVAL_FULL_ERROR") == "1" else user_failure(err)
        if known is None:
            raise
        discard_job_dir(job_dir)
        print(known.line(), file=sys.stderr)
        sys.exit(2)
    finally:
        sys.unraisablehook = previous_hook


def _check_job_dir_text(job_dir: Path) -> None:
    """The job directory's path is valid UTF-8: the results store and result.json keep it as text (a working
    directory in another encoding made ``start_run`` fail with a UnicodeEncodeError)."""
    from mergeval.core.errors import UTF8_FIX, is_utf8, shown

    if not is_utf8(str(job_dir)):
        raise UserError(
            "hydra.run.dir",
            f"the job directory {shown(str(job_dir))} has bytes that are not UTF-8 text",
            f"{UTF8_FIX}; run from such a directory or set hydra.run.dir=DIR",
        )


def run_cli(hydra_main, entry: str = "mergeval", summary: str = "", sections: dict | None = None) -> None:
    """Run a Hydra main with mergeval's error contract: a UserError, a composition error, a fault of the
    environment or an interruption (Ctrl-C, SIGTERM) is one line on stderr and exit status 2;
    HYDRA_FULL_ERROR=1 shows the traceback instead. ``--help``/``-h`` print mergeval's help for ``entry``
    (mergeval/run/help.py); Hydra's stays at --hydra-help. ``sections``: the command's own top-level config sections
    and their schemas (mergeval.search's ``search``), whose mappings take new keys as the run config's do."""
    atexit.register(skip_final_collection)
    _run_cli(hydra_main, entry, summary, sections)


def skip_final_collection() -> None:
    """At exit (an atexit handler): put every object still alive in the collector's permanent generation.

    The interpreter's last garbage collection walks every object that torch, numba, transformers and the run created, to
    free memory that the process's end hands back anyway; after a short merge it was most of the time between the
    merge's end and the process's end. The rest of the exit is unchanged (the other atexit handlers, such as logging's
    flush, and the modules' teardown); only objects held in reference cycles are not finalized, which Python never
    promises at exit, and a command has closed its files, stores and directories before it returns."""
    gc.freeze()


def end_now(status: int) -> NoReturn:
    """End an interrupted command (or one a failure stopped mid-merge) with ``status`` once its own cleanup is
    done: the atexit handlers run (logging's flush, Ray's shutdown, weakref finalizers), output is flushed, and
    the process ends without the interpreter's teardown.

    Why: a merge stopped early leaves its worker threads to finish the units they were merging
    (``merge.execute.run_plan``), and the teardown would wait for them (as long as the slowest unit, DELLA's ranks over
    a whole embedding, takes; an 8B Llama's has 19 times SmolLM2's entries) and then finalize torch, numba and the BLAS
    libraries with threads around. Everything the command promises on an interruption or a failure (no half-written
    output, the run recorded as interrupted or failed, its claims released) is done before this point, in the handlers
    the exception ran through; the abandoned threads only compute, so nothing is lost with them."""
    import ctypes

    interruption_reported()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
                pass
        ctypes.CDLL(None).fflush(None)  # what native libraries printed through C's stdio
        os._exit(status)


def _run_cli(hydra_main, entry: str, summary: str, sections: dict | None) -> None:
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        from mergeval.run.help import help_text

        print(help_text(entry, summary))
        sys.exit(0)
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("MERGEVAL_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # composition errors reach us instead of Hydra's multi-line report
    os.environ["MERGEVAL_FULL_ERROR"] = "1" if full_error else "0"  # what the user asked, for failing_cleanly
    handle_sigterm()
    from mergeval.run.config import open_mappings

    # eval.gen_kwargs={...} as the README writes it; a mapping's key in an experiment's sweep is opened alike by
    # mergeval's basic sweeper (hydra_plugins/mergeval_basic_sweeper)
    sys.argv[1:] = open_mappings(sys.argv[1:], sections)
    # multiprocessing's helper processes (the resource tracker that joblib's launcher starts) get the -W options
    # of sys.warnoptions. When an interrupted sweep's workers are killed, the tracker warns at its exit, over
    # two lines, about the semaphores they held; it removes them, which is its job, so the warning is noise
    # after the interruption's one line.
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")
    progress = None
    try:
        from mergeval.run.sweep_check import code_in_config, might_sweep

        refused = code_in_config(sys.argv[1:])
        if refused is not None:
            print(f"mergeval: error: {refused}", file=sys.stderr)
            sys.exit(2)

        if might_sweep(sys.argv[1:]):  # -m, or an experiment that sets hydra.mode=MULTIRUN
            from mergeval.run.sweep_check import check_sweep

            problems = check_sweep(sys.argv[1:])
            if problems:
                print("\n".join(f"mergeval: error: {p}" for p in problems), file=sys.stderr)
                sys.exit(2)
            if entry == "mergeval":  # jobs done / total, best so far, time left (mergeval/run/progress.py)
                from mergeval.run.progress import watch

                progress = watch(sys.argv[1:])
        try:
            hydra_main()
        except BaseException:
            if progress is not None:
                progress.stop(final=False)
            raise
        if progress is not None:
            progress.stop(final=True)
        if _unreported is not None:  # interrupted, and the exception was swallowed on its way (see _on_signal)
            raise Interrupted("SIGTERM") if _unreported == signal.SIGTERM else KeyboardInterrupt
    except KeyboardInterrupt as err:
        interruption_reported()
        if full_error:
            raise
        which = "SIGTERM" if isinstance(err, Interrupted) else "Ctrl-C"
        print(
            f"mergeval: interrupted by {which}: stopped, nothing half-written left{_AFTER_INTERRUPTION.get(entry, '')}",
            file=sys.stderr,
        )
        end_now(2)
    except SystemExit as ex:  # a job's failure, its one line printed (failing_cleanly)
        if ex.code == 2:
            _exit_after_error()
        raise
    except Exception as ex:
        known = None if full_error else user_failure(ex)
        if known is not None:
            known = _in_job_dir(ex, known)
            print(known.line(), file=sys.stderr)
            _exit_after_error()
        line = None if full_error else explain(ex)
        job_dir = hydra_job_dir(ex.__traceback__)[0] if line is not None else None
        if job_dir is not None:  # Hydra failed setting a job up
            discard_job_dir(job_dir)
        if line is None:  # unexpected: its traceback, as Python reports it, and status 1
            if _merge_abandoned():
                sys.excepthook(type(ex), ex, ex.__traceback__)
                end_now(1)
            raise
        print(f"mergeval: error: {line}", file=sys.stderr)
        _exit_after_error()


# What an interrupted command leaves for the next one, by entry point (the others keep nothing to continue from).
_AFTER_INTERRUPTION = {
    **dict.fromkeys(
        ("mergeval", "mergeval.staged", "mergeval.search"),
        " (the run is recorded as interrupted); run the same command again to continue, finished "
        "evaluations are reused",
    ),
    "mergeval.merge": "; run the same command again to merge (experts already built are reused)",
}


def _in_job_dir(ex: BaseException, known: UserError) -> UserError:
    """An OSError that reaches ``_run_cli`` unhandled came from Hydra itself, not from a job (``failing_cleanly``
    handles those): making the job directory or writing its ``.hydra`` files on a full disk or past ``ulimit -f``.
    Such a write names no file, so the line names the job directory, and what Hydra wrote of it goes (a
    truncated hydra.yaml is worse than none). Hydra has reset its HydraConfig by then; the directory is read
    from the frame of Hydra's ``run_job`` (its public function; ``output_dir`` is the directory it made)."""
    os_error = os_error_in(ex)
    if os_error is None:
        return known
    job_dir, swept = hydra_job_dir(ex.__traceback__)
    if job_dir is None:
        return known
    discard_job_dir(job_dir)
    if os_error.filename is not None and not os.fsdecode(os_error.filename).startswith(str(job_dir)):
        return known  # another file (a log file the user's config names): the line already names it
    field = "hydra.sweep.dir" if swept else "hydra.run.dir"
    return UserError(
        field,
        f"cannot write the job directory {job_dir} ({known.problem})",
        f"{known.fix}; or choose another directory with {field}=DIR",
    )


def _merge_abandoned() -> bool:
    """Whether a merge stopped by the error left worker threads finishing units nobody will use: the
    interpreter's exit would wait for them (seconds on a large tensor, minutes on an 8B model's embedding)
    before the user gets the prompt back."""
    execute = sys.modules.get("mergeval.merge.execute")  # not imported: no merge ran
    return execute is not None and execute.abandoned_units()


def _exit_after_error() -> NoReturn:
    """Exit with status 2 after a failure's one line; at once, as an interrupted command ends (``end_now``: its
    cleanup ran while the error propagated), when a merge left units running."""
    if _merge_abandoned():
        end_now(2)
    sys.exit(2)
