"""Environment variables: the one way causalkv reads them (a leaf: imports only causalkv.errors, no torch).

Every ``CAUSALKV_*`` variable causalkv, its hosts and its bridges read goes through one of
these (tests/test_env.py scans for raw reads); a variable another program defines may be
read that program's way (torchrun's ``WORLD_SIZE`` and ``RANK``: ints; vLLM-Omni's
``AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH``, an int its engine checks):

- `text`: a free value (a path: ``CAUSALKV_HOME``), None when unset or blank;
- `names`: a comma-separated list of names (``CAUSALKV_PLUGINS``), None when unset;
- `flag`: an on/off switch, with one truthiness rule: ``1``/``true``/``yes``/``on`` is on,
  ``0``/``false``/``no``/``off`` is off (case and surrounding blanks ignored), unset or blank is
  the default; any other value is a `ConfigError` naming the variable, the value and the
  values it takes (``strict=False``: read as the default, for a caller that must never raise);
- `choice`: one name of a fixed set (case and blanks ignored; unset or blank: the default);
  another value is a `ConfigError` naming the variable, the value and the choices.

`Switch` describes a documented variable with a fixed set of values, and `check_switches`
refuses, up front, one set to a value it does not take (the ``causalkv`` command checks
those of causalkv's plugin manager and of its bridges before any command runs).

    from causalkv import env

    on = env.flag("CAUSALKV_TRACE_PLUGINS", default=False)
    codec = env.choice("CAUSALKV_SGLANG_LINGBOT_QVG", ("causalkv", "sglang"), default="causalkv")
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import NamedTuple, overload

from causalkv.errors import ConfigError

__all__ = ["FLAG_VALUES", "OFF", "ON", "Switch", "check_switches", "choice", "flag", "names", "text"]

#: the values of a flag that turn it on, and those that turn it off (lower case)
ON: tuple[str, ...] = ("1", "true", "yes", "on")
OFF: tuple[str, ...] = ("0", "false", "no", "off")
#: every value a flag takes (unset or blank: its default)
FLAG_VALUES: tuple[str, ...] = (*ON, *OFF)


def text(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``name``'s value as set (``environ``, default ``os.environ``); None when unset or blank."""
    raw = (os.environ if environ is None else environ).get(name)
    return None if raw is None or not raw.strip() else raw


def names(name: str, environ: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """The comma-separated names ``name`` is set to (blanks around each stripped, empty parts
    dropped); None when unset. Set but blank: no names (an empty set, not None)."""
    raw = (os.environ if environ is None else environ).get(name)
    return None if raw is None else frozenset(part.strip() for part in raw.split(",") if part.strip())


def flag(
    name: str,
    *,
    default: bool,
    meaning: str = "",
    environ: Mapping[str, str] | None = None,
    strict: bool = True,
) -> bool:
    """Whether the switch ``name`` is on: `ON` values True, `OFF` values False, unset or
    blank ``default``.

    Args:
        meaning: what the switch does, said in the error (e.g. ``"1 prints every plugin hook
            call"``).
        strict: False reads a value outside `FLAG_VALUES` as ``default`` instead of raising.

    Raises:
        ConfigError: (``strict``) a value outside `FLAG_VALUES`, naming the variable, the value
            and the values it takes.
    """
    raw = text(name, environ)
    if raw is None or (not strict and raw.strip().lower() not in FLAG_VALUES):
        return default
    return choice(name, FLAG_VALUES, default=None, meaning=meaning, environ=environ) in ON


@overload
def choice(name: str, choices: Iterable[str], *, default: str, meaning: str = "",
           environ: Mapping[str, str] | None = None) -> str: ...
@overload
def choice(name: str, choices: Iterable[str], *, default: None, meaning: str = "",
           environ: Mapping[str, str] | None = None) -> str | None: ...
def choice(
    name: str,
    choices: Iterable[str],
    *,
    default: str | None,
    meaning: str = "",
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The name of ``choices`` that ``name`` is set to (lower case), ``default`` when unset or
    blank.

    Raises:
        ConfigError: another value, naming the variable, the value, the choices and ``meaning``
            (what the choice decides).
    """
    raw = text(name, environ)
    if raw is None:
        return default
    value = raw.strip().lower()
    names = tuple(choices)
    if value not in names:
        what = f" ({meaning})" if meaning else ""
        raise ConfigError(f"{name}={raw!r}: choose one of {list(names)}{what}, or unset it")
    return value


class Switch(NamedTuple):
    """A documented variable with a fixed set of values, for `check_switches`.

    Attributes:
        name: the variable.
        values: the values it takes (lower case; `FLAG_VALUES` for a flag); unset or blank is
            always accepted (its default).
        meaning: what its values do, said in the refusal.
    """

    name: str
    values: tuple[str, ...]
    meaning: str


def check_switches(switches: Iterable[Switch], environ: Mapping[str, str] | None = None) -> None:
    """Refuse a switch set to a value it does not take (``CAUSALKV_TRACE_PLUGINS=2`` would
    otherwise be read as off where a caller reads it leniently).

    Raises:
        ConfigError: the first such switch: ``NAME='value' is not one of its values (...):
            <meaning>; set one of them or unset it``.
    """
    for switch in switches:
        raw = text(switch.name, environ)
        if raw is not None and raw.strip().lower() not in switch.values:
            shown = ", ".join(switch.values) + " or empty"
            raise ConfigError(
                f"{switch.name}={raw!r} is not one of its values ({shown}): {switch.meaning}; "
                "set one of them or unset it"
            )
