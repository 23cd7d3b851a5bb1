"""The package's error base, the errors every layer shares, and the one int check.

Every error causalkv raises on purpose derives from `CausalKVError`, so a host (the
``causalkv`` command line included) catches one type. Each concrete error also derives from
the builtin it has always been (``ValueError`` or ``RuntimeError``), so existing
``except ValueError`` code keeps working. ``exit_code`` is the status ``causalkv generate``
ends with for it (docs/usage.md, "Errors and exit codes"). Torch-free.
"""

from __future__ import annotations

__all__ = [
    "CausalKVError",
    "ConfigError",
    "EncoderError",
    "NonFiniteLatentsError",
    "check_int",
]


class CausalKVError(Exception):
    """Base of every error causalkv raises on purpose (bad input, conflicts, contract breaks)."""

    #: the exit status of ``causalkv generate`` (2: a bad request, the default)
    exit_code: int = 2


class ConfigError(CausalKVError, ValueError):
    """A settings record (`ServerArgs`, `StreamSettings`, `QVGKVQuantArgs`, ...) holds a bad value."""


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
        name: what the value is, as the user wrote it (``"--frames"``, ``"KVCacheSpec.num_heads"``).
        minimum: the smallest accepted value (1 for "positive").
        hint: the fix, appended after ``"; "``.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise error(f"{name} must be {what}, got {value!r}" + (f"; {hint}" if hint else ""))
    return value
