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
quietly with exit 0 (`causalkv.cli.reader_gone`).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from causalkv.cli.reader_gone import flush_stdout, silence_stdout, stdout_reader_gone
from causalkv.cli.signals import Terminated, sigterm_raises
from causalkv.lazy import lazy_names

__all__ = ["build_parser", "main", "print_stderr"]

#: the line of a signal that arrives before a command's own handling (imports, parsing)
STARTING = "causalkv: {how} while starting (before any work); nothing written"


def main(argv: Sequence[str] | None = None) -> int:
    """The ``causalkv`` command: import the commands, parse ``argv``, run one.

    A reader of stdout that goes away (``| head -n 1``) ends every command quietly, exit 0
    (`causalkv.cli.reader_gone`): what the command printed is flushed here, before the
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
        print_stderr(STARTING.format(how="interrupted"))
        return 128 + signal.SIGINT
    except Terminated:
        print_stderr(STARTING.format(how="terminated"))
        return 128 + signal.SIGTERM


def print_stderr(line: str) -> None:
    """Print ``line`` on stderr; nothing when stderr is closed or gone."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):  # stderr closed or gone
        pass

#: the parser needs the commands, which import torch: imported on first use
__getattr__ = lazy_names("causalkv.cli", {"build_parser": "causalkv.cli.commands"})


if __name__ == "__main__":
    sys.exit(main())
