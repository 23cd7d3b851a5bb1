"""Typed option records: the knobs an extension (a stage family, a cache) declares for itself.

An options record is a frozen dataclass deriving from `Options` (`StageOptions` for a stage
family's request knobs, `CacheOptions` for a cache's settings; a family's model-config keys
derive from `Options` itself); each field is declared with `option(...)`, which gives its
help, its command-line flag, its ``causalkv.json`` / dict key and its bounds. A host builds
the command line (one argument group per record), reads config files and validates from these
declarations alone, so it knows no family or cache by name::

    @dataclass(frozen=True)
    class MotionOptions(StageOptions):
        title = "LingBot-World motion"
        motion: tuple[str, ...] | None = option(
            None, help="camera motion per chunk: m or s", flag="--motion", parse=parse_motion)

A record validates itself on construction: every field against its declaration (bounds,
choices, switches), then `validate` (override it for rules across fields; raise `ConfigError`
naming the flag and the fix). A request that gives a record to an extension it did not choose
is refused with `foreign_options_error`, the one message for that. Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar, TypeVar

from causalkv.errors import ConfigError, int_requirement, is_int

__all__ = [
    "CacheOptions",
    "OptionSpec",
    "Options",
    "StageOptions",
    "cache_record_for",
    "foreign_options_error",
    "option",
]

_META = "causalkv.option"
T = TypeVar("T", bound="Options")


@dataclass(frozen=True)
class OptionSpec:
    """How one field of an `Options` record is spelled outside Python, and its bounds.

    Attributes:
        help: one line for ``--help``.
        flag: the command-line flag (``"--shot-durations"``); None: not on the command line.
        key: the ``causalkv.json`` / dict key (default: the field name).
        type: argparse's ``type`` for the flag's text (``int``, ``float``, ``str``).
        parse: turns a flag's or a config value into the field's value (after ``type``);
            raises `ConfigError` naming the flag for a bad value.
        choices: the flag's accepted texts (shown in ``--help``); without ``parse`` also the
            values the field accepts. A callable returning them is called when the flag is
            added (choices a registry grows, such as the codec settings plugins register).
        metavar: the flag's value name in ``--help``.
        action: ``"store_true"`` / ``"store_false"`` for a switch without a value (the field
            must then be True or False).
        minimum: the field is an int (not a bool) ``>= minimum`` (or None when its default is
            None).
    """

    help: str
    flag: str | None = None
    key: str | None = None
    type: Callable[[str], Any] | None = None
    parse: Callable[[Any], Any] | None = None
    choices: tuple[Any, ...] | Callable[[], tuple[Any, ...]] | None = None
    metavar: str | None = None
    action: str | None = None
    minimum: int | None = None

    def read(self, raw: Any) -> Any:
        """A flag's or config value as the field's value: `parse` applied (None stays None)."""
        return self.parse(raw) if self.parse is not None and raw is not None else raw

    def choice_values(self) -> tuple[Any, ...] | None:
        """`choices`, called when it is a callable."""
        return self.choices() if callable(self.choices) else self.choices


def option(default: Any = MISSING, *, default_factory: Any = MISSING, **spec: Any) -> Any:
    """A dataclass field of an `Options` record, with its `OptionSpec` (``spec``: its fields,
    ``help`` required)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_META: OptionSpec(**spec)})


@dataclass(frozen=True)
class Options:
    """Base of the option records that stage families and caches declare (frozen dataclasses).

    Class attributes (all optional):
        title: the ``--help`` group title (``"LongLive 2.0 shots"``).
        label: how a refusal names the record's flags as a group (``"shot flags"``: the
            message then lists all of them); None: the flags that were given.
        scope: what the options apply to, for a refusal (``"multi-shot stages"``); None: the
            owner the host names.
        pick: what to pick instead, for a refusal (``"a LongLive 2.0 model"``).
    """

    title: ClassVar[str] = "options"
    label: ClassVar[str | None] = None
    scope: ClassVar[str | None] = None
    pick: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        for name in self.specs():
            value = getattr(self, name)
            if (problem := self.field_problem(name, value)) is not None:
                raise ConfigError(f"{self.label_of(name)} {problem}, got {value!r}")
        self.validate()

    def validate(self) -> Any:
        """Rules across fields (subclasses): raise `ConfigError` naming the flag and the fix."""
        return self

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
    def label_of(cls, name: str) -> str:
        """How messages name field ``name``: its flag, else its config key."""
        spec = cls.specs()[name]
        return spec.flag or spec.key or name

    @classmethod
    def field_problem(cls, name: str, value: Any) -> str | None:
        """What is wrong with ``value`` for field ``name`` by its declaration (None: nothing):
        ``"must be a positive int"``, ``"must be one of [...]"``, ``"must be True or False"``."""
        spec = cls.specs()[name]
        optional = cls._defaults().get(name, 0) is None
        if value is None and optional:
            return None
        if spec.minimum is not None and not is_int(value, spec.minimum):
            return cls._int_problem(spec.minimum, optional=optional and spec.flag is None)
        if spec.action in ("store_true", "store_false") and not isinstance(value, bool):
            return "must be True or False"
        choices = spec.choice_values()
        if choices is not None and spec.parse is None and value not in choices:
            return f"must be one of {list(choices)}"
        return None

    @classmethod
    def _int_problem(cls, minimum: int, *, optional: bool) -> str:
        return int_requirement(minimum, optional=optional)

    @classmethod
    def _dest(cls, name: str) -> str:
        return f"{cls.__module__}.{cls.__qualname__}.{name}"

    # ---- hooks a record may override ---------------------------------------------------------
    def check_used(self) -> None:
        """Refuse given fields that would do nothing under this record's own values
        (`ConfigError`; e.g. QVG settings while quantization is off). Nothing here."""

    def check_layout(self, head_dim: int) -> Any:
        """Refuse values that cannot serve K/V of ``head_dim`` channels (`ConfigError`; the
        QVG settings: a block size that does not divide it); return self. Nothing here."""
        return self

    def requires(self) -> dict[str, str]:
        """Cache features these values need -> why, as the user wrote it
        (``{"quant:qvg": "--kv-cache-quant int2"}``). None here."""
        return {}

    def describe(self) -> str:
        """One line for the run header and the metrics: the fields that differ from their
        defaults (``"default"`` when none do)."""
        return ", ".join(f"{k}={v!r}" for k, v in self.changed().items()) or "default"

    # ---- the command line ----------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, title: str | None = None) -> None:
        """Add one argument group (``title``, default `title`) of this record's flags; each
        flag's help ends with ``(default: X)`` unless the help names its default itself.

        A flag left out is absent from the parsed namespace (not a default), so
        `given_in` tells what the user typed.
        """
        group = parser.add_argument_group(title or cls.title)
        defaults = cls._defaults()
        for name, spec in cls.specs().items():
            if not spec.flag:
                continue
            kw: dict[str, Any] = {"dest": cls._dest(name), "default": argparse.SUPPRESS, "help": spec.help}
            if spec.action is not None:  # a switch: its help says what it does
                kw["action"] = spec.action
            else:
                if defaults.get(name) is not None and "(default" not in spec.help:  # said once
                    kw["help"] = f"{spec.help} (default: {defaults[name]})"
                metavar = spec.metavar
                if metavar is None and spec.choices is None:
                    metavar = spec.flag.lstrip("-").replace("-", "_").upper()
                kw.update(type=spec.type, choices=spec.choice_values(), metavar=metavar)
            group.add_argument(spec.flag, **kw)

    @classmethod
    def given_in(cls, namespace: argparse.Namespace) -> dict[str, Any]:
        """Field name -> value of this record's flags present in ``namespace`` (parsed)."""
        values = vars(namespace)
        return {name: spec.read(values[cls._dest(name)]) for name, spec in cls.specs().items()
                if cls._dest(name) in values}

    # ---- config files and dicts ----------------------------------------------------------
    @classmethod
    def from_mapping(cls: type[T], values: Mapping[str, Any], *, source: str = "config") -> T:
        """A validated record from config ``values`` (the records' keys; defaults for keys left
        out). Raises `ConfigError` naming ``source`` for a key this record does not declare."""
        keys = cls.keys()
        if unknown := sorted(set(values) - set(keys)):
            raise ConfigError(
                f"{source}: unknown {cls.title} key(s) {', '.join(map(repr, unknown))}; "
                f"choose among: {', '.join(keys)}"
            )
        specs = cls.specs()
        return cls(**{keys[key]: specs[keys[key]].read(raw) for key, raw in values.items()})

    def to_mapping(self) -> dict[str, Any]:
        """Config key -> value of every declared field."""
        return {spec.key or name: getattr(self, name) for name, spec in self.specs().items()}

    def changed(self) -> dict[str, Any]:
        """Field name -> value of the fields that differ from their defaults."""
        defaults = self._defaults()
        return {n: getattr(self, n) for n in self.specs() if getattr(self, n) != defaults.get(n)}

    def given_labels(self) -> list[str]:
        """The flags (or keys) of the fields that differ from their defaults, in order."""
        return [self.label_of(n) for n in self.changed()]

    @classmethod
    def _defaults(cls) -> dict[str, Any]:
        return {f.name: f.default_factory() if f.default is MISSING else f.default
                for f in dataclasses.fields(cls)
                if f.default is not MISSING or f.default_factory is not MISSING}


@dataclass(frozen=True)
class StageOptions(Options):
    """A stage family's request knobs (``StageRegistration(options=...)``): the host gives
    the record to the stage it chose and refuses it for any other stage."""


@dataclass(frozen=True)
class CacheOptions(Options):
    """A cache's settings (``CacheFactory(options=...)``): the host gives the record to the
    cache it chose (``factory.build(spec, options)``) and refuses it for any other cache."""


def foreign_options_error(
    record: Options, *, chosen: str, owner: str | None = None, alternative: str | None = None
) -> ConfigError:
    """The one error for options a request gives to an extension it did not choose.

    Names the options (the record's `label` and all its flags, or the flags given), what
    they apply to (the record's `scope`, else ``owner``), the ``chosen`` extension, the
    ``owner`` (when the host knows it) and the fix (the record's `pick`, else ``alternative``)::

        --motion applies to LingBot-World's interactive window, not to WanCausalDMDStage
        (stage 'self-forcing-wan'); it is an option of stage 'lingbot-world'; drop it or pick
        a LingBot-World model
    """
    cls = type(record)
    if cls.label:
        what, many = f"{cls.label} ({', '.join(cls.label_of(n) for n in cls.specs())})", True
    else:
        given = record.given_labels()
        what, many = ", ".join(given), len(given) > 1
    text = f"{what} appl{'y' if many else 'ies'} to {cls.scope or owner or cls.title}, not to {chosen}"
    if owner and cls.scope:
        text += f"; {'they are options' if many else 'it is an option'} of {owner}"
    fix = f"drop {'them' if many else 'it'}"
    if alternative := cls.pick or alternative:
        fix += f" or pick {alternative}"
    return ConfigError(f"{text}; {fix}")


def cache_record_for(factory: object, records: Sequence[Options]) -> CacheOptions | None:
    """The settings record a cache of ``factory`` is built with, among a request's ``records``:
    the one of the factory's declared ``options`` class (its defaults when the request gives
    none); for a factory that declares none, the request's cache record that asks for a
    feature (`Options.requires`, e.g. QVG bits: ``quant:qvg``, which the chosen cache covers),
    else None."""
    declared = getattr(factory, "options", None)
    if isinstance(declared, type) and issubclass(declared, CacheOptions):
        return next((r for r in records if isinstance(r, declared)), None) or declared()
    return next((r for r in records if isinstance(r, CacheOptions) and r.requires()), None)
