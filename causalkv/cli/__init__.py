"""The ``causalkv`` command line: one module per subcommand in this package.

Subcommands: ``generate`` (`causalkv.cli.generate`), ``plugins`` and ``resolve``
(`causalkv.cli.plugins`), ``demo`` (`causalkv.cli.demo`), ``sglang-checkpoint``
and ``vllm-omni-checkpoint`` (`causalkv.cli.checkpoints`),
``memory`` (`causalkv.cli.memory`); the parser is
`causalkv.cli.commands`. Every error causalkv raises on purpose
(`causalkv.errors.CausalKVError`) ends the command with one line on stderr and exit status 2;
usage errors are one line too (exit 2). ``generate``'s exit statuses for every fault are
listed in `causalkv.cli.faults`.

This module is light (no torch): `main` is the console script, and a SIGINT or SIGTERM while
the commands import (torch, diffusers: seconds) or parse ends in one line, exit 130 or 143.
A reader of stdout that goes away (``causalkv plugins | head -n 1``) ends any command
quietly with exit 0: a ``BrokenPipeError`` of stdout that leaves a command, or that the
final flush of what it printed raises, ends it with nothing on stderr (docs/usage.md, "Errors
and exit codes": printing stops, the files are still written). File descriptor 1 is then
pointed at ``/dev/null``, so the interpreter's own flush at exit has nowhere to fail (the
recipe of Python's ``signal`` documentation, "Note on SIGPIPE"). A ``BrokenPipeError`` of
anything else (a child process's pipe, a socket) is not this case and is left alone.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from causalkv.errors import print_stderr
from causalkv.lazy import lazy_names
from causalkv.runtime.processes import launch

__all__ = ["Terminated", "build_parser", "main"]

#: the line of a signal that arrives before a command's own handling (imports, parsing)
STARTING = "causalkv: {how} while starting (before any work); nothing written"


def main(argv: Sequence[str] | None = None) -> int:
    """The ``causalkv`` command: import the commands, parse ``argv``, run one.

    A reader of stdout that goes away (``| head -n 1``) ends every command quietly, exit 0
    (module docstring): what the command printed is flushed here, before the
    interpreter's exit, and a ``BrokenPipeError`` of stdout leaves no traceback."""
    try:
        with sigterm_raises():
            # lazy: the commands import torch; a signal during that import is one line here
            from causalkv.cli.commands import main as run

            try:
                code = run(argv)
            except SystemExit:  # --help, --version, a usage error: their text is buffered too
                flush_stdout()
                raise
            flush_stdout()
            return code
    except BrokenPipeError:
        if not stdout_reader_gone():  # another pipe broke: not the reader going away
            raise
        silence_stdout()
        return 0
    except KeyboardInterrupt:
        return _ended_starting("interrupted", 128 + signal.SIGINT)
    except Terminated:
        return _ended_starting("terminated", 128 + signal.SIGTERM)


def _ended_starting(how: str, code: int) -> int:
    """The `STARTING` line and ``code``: printed, or in a rank of a supervised job
    (`causalkv.runtime.processes.launch`) reported to the launcher, which prints the job's one
    line (this rank was stopped: a peer's fault or the user's signal speaks for the job)."""
    line = STARTING.format(how=how)
    if launch.reports_to_launcher():
        launch.report_end(line, code)
    else:
        print_stderr(line)
    return code


class Terminated(BaseException):
    """SIGTERM, raised in the main thread the way SIGINT raises ``KeyboardInterrupt`` (a
    ``BaseException``, so ``except Exception`` cleanup code lets it through)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM is ignored
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` in the main thread, once. An inherited
    ``SIG_IGN`` is kept.

    Nested in another such block (`causalkv.cli.faults.run_guarded`'s in `main`'s), the inner
    block's end leaves SIGTERM ignored instead of raising again: the command is ending, and
    its line or its report to the launcher is written after that block, inside the outer one.
    A SIGTERM then (torchrun stopping a rank whose peer died, while the rank reports the
    peer's failure) must not cut that short or replace it. The outermost block restores what
    it found."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN if previous is _raise_terminated else previous)


def silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null so no later write or flush of stdout can fail."""
    # a stdout without a descriptor (captured): nothing to point
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)


def stdout_reader_gone() -> bool:
    """Is stdout a pipe (or socket) whose reading end is closed? Asked of the descriptor
    itself (``poll``: a pipe without readers reports an error), so a ``BrokenPipeError`` of
    another pipe is told apart from stdout's."""
    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode) and not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor (captured), or no poll
        return False


def flush_stdout() -> None:
    """Flush what the command printed now, where a reader that went away is handled (stdout
    silenced), rather than at interpreter exit, where Python would print "Exception ignored"
    and exit 120."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
    # another write error, a closed stream, or no stdout (started with descriptor 1 closed: >&-)
    except (OSError, ValueError, AttributeError):
        pass


#: the parser needs the commands, which import torch: imported on first use
__getattr__ = lazy_names("causalkv.cli", {"build_parser": "causalkv.cli.commands"})
