"""Typed option records: the knobs an extension (a stage family, a cache) declares for itself.

An options record is a frozen dataclass deriving from `Options`; each field is declared with
`option(...)`, which gives its help, its command-line flag and its ``causalkv.json`` / dict
key. A host builds the command line (one argument group per record), reads config files and
validates from these declarations alone, so it knows no family or cache by name::

    @dataclass(frozen=True)
    class MotionOptions(Options):
        title = "LingBot-World motion"
        motion: tuple[str, ...] | None = option(
            None, help="camera motion per chunk: m or s", flag="--motion", parse=parse_motion)

A record validates itself on construction (override `validate`, raise `ConfigError` naming
the flag and the fix). Torch-free: importing it loads no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar, TypeVar

from causalkv.errors import ConfigError

__all__ = ["OptionSpec", "Options", "option"]

_META = "causalkv.option"
T = TypeVar("T", bound="Options")


@dataclass(frozen=True)
class OptionSpec:
    """How one field of an `Options` record is spelled outside Python.

    Attributes:
        help: one line for ``--help``.
        flag: the command-line flag (``"--shot-durations"``); None: not on the command line.
        key: the ``causalkv.json`` / dict key (default: the field name).
        type: argparse's ``type`` for the flag's text (``int``, ``float``, ``str``).
        parse: turns a flag's or a config value into the field's value (after ``type``);
            raises `ConfigError` naming the flag for a bad value.
        choices: the flag's accepted texts (shown in ``--help``).
        metavar: the flag's value name in ``--help``.
        action: ``"store_true"`` / ``"store_false"`` for a switch without a value.
    """

    help: str
    flag: str | None = None
    key: str | None = None
    type: Callable[[str], Any] | None = None
    parse: Callable[[Any], Any] | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    action: str | None = None


def option(
    default: Any = MISSING,
    *,
    help: str,
    flag: str | None = None,
    key: str | None = None,
    type: Callable[[str], Any] | None = None,
    parse: Callable[[Any], Any] | None = None,
    choices: tuple[Any, ...] | None = None,
    metavar: str | None = None,
    action: str | None = None,
    default_factory: Any = MISSING,
) -> Any:
    """A dataclass field of an `Options` record, with its `OptionSpec`."""
    spec = OptionSpec(help, flag, key, type, parse, choices, metavar, action)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_META: spec})


@dataclass(frozen=True)
class Options:
    """Base of the option records that stage families and caches declare (frozen dataclasses).

    Class attributes:
        title: the ``--help`` group title (``"LongLive 2.0 shots"``).
    """

    title: ClassVar[str] = "options"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` naming the flag and the fix for a bad value (subclasses)."""

    # ---- the declarations ----------------------------------------------------------------
    @classmethod
    def specs(cls) -> dict[str, OptionSpec]:
        """Field name -> `OptionSpec`, in declaration order (fields without one are skipped)."""
        return {f.name: f.metadata[_META] for f in dataclasses.fields(cls) if _META in f.metadata}

    @classmethod
    def keys(cls) -> dict[str, str]:
        """Config key -> field name."""
        return {spec.key or name: name for name, spec in cls.specs().items()}

    @classmethod
    def flags(cls) -> dict[str, str]:
        """Flag -> field name (fields with a flag)."""
        return {spec.flag: name for name, spec in cls.specs().items() if spec.flag}

    @classmethod
    def _dest(cls, name: str) -> str:
        return f"{cls.__module__}.{cls.__qualname__}.{name}"

    # ---- the command line ----------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one argument group of this record's flags to ``parser``.

        A flag left out is absent from the parsed namespace (not a default), so
        `given_in` tells what the user typed.
        """
        group = parser.add_argument_group(cls.title)
        defaults = cls._defaults()
        for name, spec in cls.specs().items():
            if not spec.flag:
                continue
            kw: dict[str, Any] = {"dest": cls._dest(name), "default": argparse.SUPPRESS}
            shown = defaults.get(name)
            help_text = spec.help
            if spec.action is not None:  # a switch: its help says what it does
                kw["action"] = spec.action
            else:
                if shown is not None:
                    help_text = f"{spec.help} (default: {shown})"
                metavar = spec.metavar
                if metavar is None and spec.choices is None:
                    metavar = spec.flag.lstrip("-").replace("-", "_").upper()
                kw.update(type=spec.type, choices=spec.choices, metavar=metavar)
            group.add_argument(spec.flag, help=help_text, **kw)

    @classmethod
    def given_in(cls, namespace: argparse.Namespace) -> dict[str, Any]:
        """Field name -> value of this record's flags present in ``namespace`` (parsed)."""
        values = vars(namespace)
        out: dict[str, Any] = {}
        for name, spec in cls.specs().items():
            dest = cls._dest(name)
            if dest in values:
                raw = values[dest]
                out[name] = spec.parse(raw) if spec.parse is not None else raw
        return out

    # ---- config files and dicts ----------------------------------------------------------
    @classmethod
    def parse_mapping(cls, values: Mapping[str, Any], *, source: str) -> dict[str, Any]:
        """Field name -> value for the config ``values`` (keys are the records' keys).

        Raises `ConfigError` naming ``source`` for a key this record does not declare.
        """
        keys = cls.keys()
        unknown = sorted(set(values) - set(keys))
        if unknown:
            raise ConfigError(
                f"{source}: unknown {cls.title} key(s) {', '.join(map(repr, unknown))}; "
                f"choose among: {', '.join(keys)}"
            )
        specs = cls.specs()
        out = {}
        for key, raw in values.items():
            name = keys[key]
            parse = specs[name].parse
            out[name] = parse(raw) if parse is not None and raw is not None else raw
        return out

    @classmethod
    def from_mapping(cls: type[T], values: Mapping[str, Any], *, source: str = "config") -> T:
        """A validated record from config ``values`` (defaults for keys left out)."""
        return cls(**cls.parse_mapping(values, source=source))

    def to_mapping(self) -> dict[str, Any]:
        """Config key -> value of every declared field."""
        return {spec.key or name: getattr(self, name) for name, spec in self.specs().items()}

    def changed(self) -> dict[str, Any]:
        """Field name -> value of the fields that differ from their defaults."""
        defaults = self._defaults()
        return {n: getattr(self, n) for n in self.specs() if getattr(self, n) != defaults.get(n)}

    @classmethod
    def _defaults(cls) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not MISSING:
                out[f.name] = f.default
            elif f.default_factory is not MISSING:
                out[f.name] = f.default_factory()
        return out
