"""The package's error base and the one int check every settings record uses.

Every error causalkv raises on purpose derives from `CausalKVError`, so a host (the
``causalkv`` command line included) catches one type. Each concrete error also derives from
the builtin it has always been (``ValueError`` or ``RuntimeError``), so existing
``except ValueError`` code keeps working. Torch-free.
"""

from __future__ import annotations

__all__ = ["CausalKVError", "ConfigError", "check_int"]


class CausalKVError(Exception):
    """Base of every error causalkv raises on purpose (bad input, conflicts, contract breaks)."""


class ConfigError(CausalKVError, ValueError):
    """A settings record (`ServerArgs`, `StreamSettings`, `QVGKVQuantArgs`, ...) holds a bad value."""


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
