"""How a command ends: one line on stderr and a documented exit status for every fault.

=====  =========================================================================================
exit   fault
=====  =========================================================================================
0      success (also when stdout is a closed pipe, e.g. ``| head -1``: the files are written)
1      an unexpected error (one line; the traceback only with ``--debug``), or a finished
       generation whose output could not be written (its latents are kept, the line says where)
2      a bad request, an unreadable or corrupt model folder, a plugin fault, or a usage error
130    interrupted (Ctrl-C): "interrupted after chunk i of N; nothing written"
=====  =========================================================================================
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from causalkv.errors import CausalKVError

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_REQUEST", "OneLineErrorParser", "Progress", "Stdout", "run_guarded"]

EXIT_ERROR = 1
EXIT_REQUEST = 2
EXIT_INTERRUPTED = 130


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit 2) pointing at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_REQUEST, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null so the interpreter's final flush cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a descriptor (captured)
        pass


class Stdout:
    """Prints progress lines; once the reader has gone (``BrokenPipeError``, e.g. ``| head -1``)
    it stops printing, and the run goes on to write its files."""

    def __init__(self) -> None:
        self.broken = False

    def __call__(self, line: str) -> None:
        if self.broken:
            return
        try:
            print(line, flush=True)
        except BrokenPipeError:
            self.broken = True
            _silence_stdout()

    def flush(self) -> None:
        if not self.broken:
            try:
                sys.stdout.flush()
            except BrokenPipeError:
                self.broken = True
                _silence_stdout()


class Progress:
    """Chunks done out of the plan's total, for the interruption message."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.done = 0

    def on_plan(self, plan: Any) -> None:
        self.total = int(plan.num_chunks)

    def on_chunk_done(self, index: int, stats: Any) -> None:
        self.done = index + 1

    def interrupted(self) -> str:
        if self.total is None:
            return "interrupted before the first chunk; nothing written"
        if self.done < self.total:
            return f"interrupted after chunk {self.done} of {self.total}; nothing written"
        return (
            f"interrupted after chunk {self.done} of {self.total}, while writing the outputs; "
            "only complete files were written"
        )


def _stderr(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):
        pass


def run_guarded(command: str, body: Callable[[], int], *, debug: bool = False, progress: Progress | None = None) -> int:
    """Run ``body`` and map what it raises to one stderr line and an exit status (module
    docstring). With ``debug`` the traceback is printed too."""

    def fail(line: str, code: int) -> int:
        if debug:
            traceback.print_exc()
        _stderr(f"{command}: {line}")
        return code

    try:
        return body()
    except KeyboardInterrupt:
        return fail((progress or Progress()).interrupted(), EXIT_INTERRUPTED)
    except CausalKVError as exc:
        return fail(f"error: {exc}", int(getattr(exc, "exit_code", EXIT_REQUEST)))
    except BrokenPipeError:  # stdout went away outside of `Stdout` (a plugin printing)
        _silence_stdout()
        return fail("error: stdout was closed before the command finished", EXIT_ERROR)
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, traceback on request
        lines = str(exc).strip().splitlines()
        what = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        hint = "" if debug else "; rerun with --debug for the traceback"
        return fail(f"unexpected error ({what}){hint}", EXIT_ERROR)
