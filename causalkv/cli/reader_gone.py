"""stdout's reader went away (``causalkv plugins | head -n 1``): the command ends quietly.

One mechanism for every command, in the light entry point (`causalkv.cli.main`): a
``BrokenPipeError`` of stdout that leaves a command, or that the final flush of what it
printed raises, ends the command with exit status 0 and nothing on stderr (docs/usage.md,
"Errors and exit codes": printing stops, the files are still written). File descriptor 1 is
then pointed at ``/dev/null``, so the interpreter's own flush at exit has nowhere to fail
(the recipe of Python's ``signal`` documentation, "Note on SIGPIPE"). A ``BrokenPipeError``
of anything else (a child process's pipe, a socket) is not this case and is left alone.

Torch-free: the entry point imports it before the commands.
"""

from __future__ import annotations

import os
import select
import stat
import sys

__all__ = ["flush_stdout", "silence_stdout", "stdout_reader_gone"]


def silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null so no later write or flush of stdout can fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a descriptor (captured)
        pass


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
    if sys.stdout is None:  # started with descriptor 1 closed (``>&-``)
        return
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
    except (OSError, ValueError):  # another write error, or a closed stream: not ours to report here
        pass
