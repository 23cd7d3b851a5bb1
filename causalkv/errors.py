"""The package's error base, the errors every layer shares, the one test of each kind of value
a setting takes (`is_int` and `check_int`, `is_number`), how a refusal says what it wants
(`int_requirement`) and offers the values around a rejected one (`multiples_around`,
`alternatives`), the one way an exception is put into a message (`first_line`,
`describe_exception`) and the one way a line goes to stderr (`print_stderr`).

Every error causalkv raises on purpose derives from `CausalKVError`, so a host (the
``causalkv`` command line included) catches one type. Each concrete error also derives from
the builtin it has always been (``ValueError``, ``RuntimeError``, ``TypeError`` or
``ImportError``), so existing ``except ValueError`` code keeps working;
``tests/test_error_family.py`` fails on a deliberate ``raise`` of a bare builtin. ``exit_code`` is the status ``causalkv generate``
ends with for it (docs/usage.md, "Errors and exit codes"). Torch-free.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterable

__all__ = [
    "CausalKVError",
    "ConfigError",
    "EncoderError",
    "ImportPathError",
    "InvalidTypeError",
    "NonFiniteLatentsError",
    "UsageError",
    "alternatives",
    "check_int",
    "describe_exception",
    "first_line",
    "int_requirement",
    "is_int",
    "is_number",
    "multiples_around",
    "print_stderr",
]


class CausalKVError(Exception):
    """Base of every error causalkv raises on purpose (bad input, conflicts, contract breaks)."""

    #: the exit status of ``causalkv generate`` (2: a bad request, the default)
    exit_code: int = 2


class ConfigError(CausalKVError, ValueError):
    """A settings record (`ServerArgs`, `StreamSettings`, `QVGKVQuantArgs`, ...) or an argument
    holds a bad value."""


class InvalidTypeError(CausalKVError, TypeError):
    """A value of the wrong type where causalkv declares one: a plugin record's field, a hook's
    return value, an argument. The message names the value and the type expected."""


class ImportPathError(CausalKVError, ImportError):
    """A ``"package.module:Attribute"`` path (a plugin record's stage or cache) that does not
    import; the message names the path and what is missing."""


class UsageError(CausalKVError, RuntimeError):
    """An object used against its contract: called out of order or outside the wrapper that
    sets it up, or asked for what it never stored. A caller's bug, not a bad request, so
    ``causalkv generate`` ends with status 1 for it, as for anything unexpected."""

    exit_code = 1


class EncoderError(CausalKVError, RuntimeError):
    """A video encoder failed or wrote a file that does not decode (exit status 1: the
    request was fine, the machine could not write it)."""

    exit_code = 1


class NonFiniteLatentsError(CausalKVError, RuntimeError):
    """A chunk's latents became NaN or infinite: the run stops there and writes nothing.

    Attributes:
        chunk: the chunk whose latents were not finite (0-based); ``num_chunks``: of how many.
    """

    exit_code = 3

    def __init__(self, message: str, *, chunk: int, num_chunks: int) -> None:
        super().__init__(message)
        self.chunk, self.num_chunks = chunk, num_chunks


def check_int(
    name: str, value: object, *, minimum: int = 0, hint: str = "", error: type[Exception] = ConfigError
) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``; else ``error`` naming it and the fix.

    Args:
        name: what the value is, as the user wrote it (``"--frames"``, ``"CausalCacheSpec.num_heads"``).
        minimum: the smallest accepted value (1 for "positive").
        hint: the fix, appended after ``"; "``.
    """
    if not is_int(value, minimum):
        fix = f"; {hint}" if hint else ""
        raise error(f"{name} {int_requirement(minimum)}, got {value!r}{fix}")
    return value


def is_number(value: object) -> bool:
    """``value`` is a finite real number: an int or a float, not a bool, not NaN or infinite."""
    return is_int(value, None) or (isinstance(value, float) and math.isfinite(value))  # not isfinite(huge int): overflows


def is_int(value: object, minimum: int | None = 1) -> bool:
    """``value`` is an int (not a bool) ``>= minimum`` (any int for ``minimum=None``)."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def int_requirement(minimum: int, *, optional: bool = False) -> str:
    """How a refusal says what `is_int` accepts: ``"must be a positive int"`` (``minimum`` 1),
    ``"must be an int >= 0"``; ``" or null"`` appended when ``optional``."""
    what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    return f"must be {what}" + (" or null" if optional else "")


def multiples_around(value: int, unit: int, base: int = 0) -> list[int]:
    """The values of the grid ``base + k x unit`` just below and above ``value`` that are
    positive, which a refusal offers as the fix: ``multiples_around(13, 4)`` is ``[12, 16]``,
    ``multiples_around(3, 4)`` is ``[4]``, ``multiples_around(7, 4, base=1)`` is ``[5, 9]``."""
    lo = value - (value - base) % unit
    return [v for v in (lo, lo + unit) if v > 0]


def alternatives(values: Iterable[object]) -> str:
    """``values`` as a fix offers them: ``"12 or 16"``, ``"4"``."""
    return " or ".join(map(str, values))


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when the message is empty)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def describe_exception(exc: BaseException) -> str:
    """``"<Type>: <first line of the message>"`` (the type's name alone for an empty message)."""
    return f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__


def print_stderr(line: str) -> None:
    """Print ``line`` on stderr; nothing when stderr is closed or gone."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr closed or gone
        print(line, file=sys.stderr, flush=True)
