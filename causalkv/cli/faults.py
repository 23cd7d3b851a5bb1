"""How a command ends: one line on stderr and a documented exit status for every fault.

=====  =========================================================================================
exit   fault
=====  =========================================================================================
0      success (also when stdout is a closed pipe, e.g. ``| head -1``, or closed: the files are
       written)
1      an unexpected error (one line; the traceback only with ``--debug``), memory that ran
       out where no check foresaw it, or a finished generation whose output could not be
       written (the line names what was kept)
2      a bad request, an unreadable or corrupt model folder, a plugin fault, a usage error,
       or a stdout that cannot be written
3      the latents became NaN or infinite: the run stops at that chunk and writes nothing
130    interrupted (SIGINT, Ctrl-C), at any moment: "interrupted while planning the request",
       "while loading the model, before chunk 1 of N", "after chunk i of N; nothing written"
       (`Progress`; before the commands import: `causalkv.cli.main`)
143    terminated (SIGTERM): the same lines with "terminated"
=====  =========================================================================================

Every command ends this way: ``demo`` and ``sglang-checkpoint`` run their body through
`run_guarded` too (`Progress`'s ``what`` says what a signal left). A signal ends the run like
an error: the file being written is removed, the files already complete are named. SIGINT
keeps the disposition the command inherited (a background job of a non-interactive shell
ignores it, so a Ctrl-C in that shell does not reach the job).

In a rank of a job ``causalkv generate --nproc-per-node N`` launched, the line is not printed:
it goes to the launching process (`causalkv.runtime.processes.launch`), which prints one line for the job.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from causalkv.cli import Terminated, sigterm_raises, silence_stdout
from causalkv.errors import CausalKVError, describe_exception, print_stderr
from causalkv.runtime.processes import launch

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_REQUEST",
    "EXIT_TERMINATED",
    "OneLineErrorParser",
    "Progress",
    "Stdout",
    "StdoutError",
    "reserve_standard_fds",
    "run_guarded",
]

EXIT_ERROR = 1
EXIT_REQUEST = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit 2) pointing at ``--help``.

    Flags are never abbreviated (``allow_abbrev=False``, also in every subcommand's parser:
    argparse makes them of this class): a prefix would be read as another flag, whose
    message then misleads (``causalkv memory --kv-cache-quant int8`` read as
    ``--kv-cache-quant-sink``), and the flags plugins add would change what a prefix means."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_REQUEST, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def reserve_standard_fds() -> None:
    """Open ``/dev/null`` on any of file descriptors 0, 1, 2 that is closed (``>&-``), so no
    file the run opens lands on one of them (a child process or a library writing to "stdout"
    would write into that file). ``sys.stdout`` stays None: the run prints nothing.

    ``os.open`` takes the lowest free descriptor: ``fd`` itself, as the lower ones are open
    by then (the loop goes up from 0)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                os.open(os.devnull, os.O_RDWR)
            except OSError:
                return


class StdoutError(CausalKVError, OSError):
    """stdout refused the first line (``/dev/full``, a device or file system error): exit 2,
    before any weights load (the first line is the run's header)."""


class Stdout:
    """Prints progress lines to stdout.

    - stdout closed (``>&-``, ``sys.stdout is None``): prints nothing, the run goes on.
    - the reader went away (``BrokenPipeError``, e.g. ``| head -1``): printing stops, the run
      goes on to write its files.
    - any other write error (``/dev/full``, EIO): on the first line `StdoutError` (the run
      has not loaded anything yet); later, one warning on stderr and printing stops.
    """

    def __init__(self) -> None:
        self.broken = False
        self.lines = 0

    def _write(self, write: Callable[[], object]) -> bool:
        """Run ``write`` unless printing stopped; whether it wrote."""
        if self.broken or sys.stdout is None:
            return False
        try:
            write()
        except OSError as exc:
            self.broken = True
            silence_stdout()
            if isinstance(exc, BrokenPipeError):
                return False
            if self.lines == 0:
                raise StdoutError(f"cannot write to stdout ({describe_exception(exc)}); redirect "
                                  "it to a file, a pipe or /dev/null") from None
            print_stderr(f"causalkv: warning: stdout failed ({describe_exception(exc)}); printing "
                         "stops, the run goes on")
            return False
        return True

    def __call__(self, line: str) -> None:
        if self._write(lambda: print(line, flush=True)):
            self.lines += 1

    def flush(self) -> None:
        self._write(lambda: sys.stdout.flush())


class Progress:
    """Where a run is, for the interruption line: planning, loading, chunks done out of the
    plan's total, and the files written. A command without chunks (``demo``,
    ``sglang-checkpoint``) gives ``what`` instead: its line is ``"{how}; {what}"``."""

    def __init__(self, what: str | None = None) -> None:
        self.what = what
        self.total: int | None = None
        self.done = 0
        self.loaded = False
        self.written: list[str] = []

    def on_plan(self, plan: Any) -> None:
        self.total = int(plan.num_chunks)

    def on_loaded(self) -> None:
        self.loaded = True

    def on_chunk_done(self, index: int, stats: Any) -> None:
        self.done = index + 1

    def on_written(self, path: Any) -> None:
        self.written.append(str(path))

    def interrupted(self, how: str) -> str:
        """``how`` (``"interrupted"``, ``"terminated"``) and where the run was."""
        if self.what is not None:
            return f"{how}; {self.what}"
        if self.total is None:
            return f"{how} while planning the request, before loading anything; nothing written"
        if not self.loaded and self.done == 0:
            return f"{how} while loading the model, before chunk 1 of {self.total}; nothing written"
        if self.done < self.total:
            return f"{how} after chunk {self.done} of {self.total}; nothing written"
        files = ", ".join(map(repr, self.written))
        kept = f"kept the complete files {files}" if files else "nothing written"
        return f"{how} after chunk {self.done} of {self.total}, while writing the outputs; {kept}"


def run_guarded(command: str, body: Callable[[], int], *, progress: Progress, debug: bool = False) -> int:
    """Run ``body`` and map what it raises to one stderr line and an exit status (module
    docstring). With ``debug`` the traceback is printed too. SIGTERM is handled like SIGINT
    while ``body`` runs (`sigterm_raises`)."""

    def fail(line: str, code: int) -> int:
        if debug:
            traceback.print_exc()
        rank = launch.reports_to_launcher()
        if rank:  # the launcher prints the job's one line (an exception is being handled here)
            launch.report_end(
                f"{command}: {line}", code, done=progress.done, total=progress.total,
                peer_failure=launch.is_peer_failure(sys.exc_info()[1]), written=progress.written,
            )
        if debug or not rank:
            print_stderr(f"{command}: {line}")
        return code

    try:
        with sigterm_raises():
            code = body()
            if launch.reports_to_launcher():
                launch.report_end("", code, done=progress.done, total=progress.total, written=progress.written)
            return code
    except KeyboardInterrupt:
        return fail(progress.interrupted("interrupted"), EXIT_INTERRUPTED)
    except Terminated:
        return fail(progress.interrupted("terminated"), EXIT_TERMINATED)
    except CausalKVError as exc:
        return fail(f"error: {exc}", exc.exit_code)
    except MemoryError:  # a size no check foresaw: one line, not a traceback
        return fail("error: out of memory; free memory or make the request smaller", EXIT_ERROR)
    except BrokenPipeError:  # stdout went away outside of `Stdout` (a plugin printing)
        silence_stdout()
        return fail("error: stdout was closed before the command finished", EXIT_ERROR)
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, traceback on request
        hint = "" if debug else "; rerun with --debug for the traceback"
        return fail(f"unexpected error ({describe_exception(exc)}){hint}", EXIT_ERROR)
