"""KV codecs: one interface, a lazy registry of codec settings by name.

A codec turns one K or V segment ``[B, H, S, D]`` into a packed record and back
(`causalkv.caches.codecs.base.KVCodec`: ``encode``, ``decode_into`` a given buffer, an exact
``nbytes`` formula from shape and settings, optionally attention straight over the record).
A *codec setting* is a name the user types (``--kv-cache-quant int4``,
``--kv-cache-quant-recent-tier fp8``) bound to a ``"module:Class"`` target and the keyword
parameters its ``from_settings`` receives. Settings are registered by name and imported on
first use (lazy "module:Class" targets), so this module imports no torch and naming a
setting costs nothing until a cache packs with it.

Built in:

======  =====================================================  ====================================
name    target                                                 what it stores
======  =====================================================  ====================================
int4    ``causalkv.caches.codecs.prq.codec:PRQCodec`` bits=4   PRQ: k-means + 4-bit residual
                                                               (docs/qvg.md)
int2    ``causalkv.caches.codecs.prq.codec:PRQCodec`` bits=2   PRQ: k-means + 2-bit residual
fp8     ``causalkv.caches.codecs.fp8:FP8Codec``                e4m3 values, an fp32 scale per token
                                                               and head
nvfp4   ``causalkv.caches.codecs.nvfp4:NVFP4Codec``            e2m1 values, an e4m3 scale per 16,
                                                               one fp32 scale per encoded segment
                                                               (the tensor)
======  =====================================================  ====================================

Each codec has one home here: PRQ's package `causalkv.caches.codecs.prq` (quantizer, packed
format, kernels, packed attention), `fp8`, `nvfp4`.

A plugin adds one with `register_codec` (from its ``causalkv_codecs`` hook or at import of
its plugin module); docs/plugins.md shows a whole codec in one module.

A setting is checked before it can change an answer: the first time a process uses it
(`make_codec`, `codec_problem`), `causalkv.caches.codecs.conformance` encodes and decodes a
probe segment with it and refuses a codec that breaks its contract, naming the check.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from causalkv.errors import ConfigError

if TYPE_CHECKING:
    from causalkv.caches.codecs.base import KVCodec

__all__ = [
    "CodecSetting",
    "codec_names",
    "codec_problem",
    "codec_setting",
    "make_codec",
    "register_codec",
    "unregister_codec",
]


@dataclass(frozen=True)
class CodecSetting:
    """One named codec setting.

    Attributes:
        name: what the user types (``"int4"``, ``"fp8"``).
        target: ``"module:Class"`` of a `KVCodec` subclass, imported on first use.
        params: keyword arguments of the class's ``from_settings`` (``{"bits": 4}``).
        help: one line for ``causalkv plugins`` and the docs.
        source: who registered it (``"causalkv"`` or the plugin's name).
    """

    name: str
    target: str
    params: dict[str, Any] = field(default_factory=dict)
    help: str = ""
    source: str = "causalkv"

    def load(self) -> type[KVCodec]:
        """The codec class (imports its module)."""
        module, _, attr = self.target.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"codec setting {self.name!r}: cannot import {self.target!r} ({exc}); "
                "check the plugin that registered it"
            ) from exc


_SETTINGS: dict[str, CodecSetting] = {}


def register_codec(
    name: str, target: str, *, help: str = "", source: str = "causalkv", **params: Any
) -> CodecSetting:
    """Register the codec setting ``name`` -> ``target`` (``"module:Class"``) with ``params``.

    Registering the same name with the same target and params again is a no-op (a plugin
    module imported twice); a different one is refused, naming both.

    Raises:
        ConfigError: a bad name or target, or ``name`` taken by another setting.
    """
    if not isinstance(name, str) or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"codec setting name must be a word like 'fp8', got {name!r}")
    if name.lower() in ("off", "none", "bf16"):
        raise ConfigError(f"codec setting name {name!r} is reserved (it means 'not packed')")
    if not isinstance(target, str) or ":" not in target:
        raise ConfigError(f"codec setting {name!r}: target must be 'module:Class', got {target!r}")
    new = CodecSetting(name, target, dict(params), help, source)
    old = _SETTINGS.get(name)
    if old is not None and (old.target, old.params) != (new.target, new.params):
        raise ConfigError(
            f"codec setting {name!r} is registered twice: {old.target} {old.params} (by "
            f"{old.source}) and {new.target} {new.params} (by {source}); rename one"
        )
    return _SETTINGS.setdefault(name, new)


def unregister_codec(name: str) -> None:
    """Remove the setting ``name`` (absent: nothing): a plugin set aside takes back the settings
    it registered (`causalkv.plugin.collect`), so a refused plugin leaves the registry as it was."""
    _SETTINGS.pop(name, None)


def codec_names() -> tuple[str, ...]:
    """Every registered setting name, built-ins first, in registration order."""
    return tuple(_SETTINGS)


def codec_setting(name: str) -> CodecSetting:
    """The setting registered as ``name``.

    Raises:
        ConfigError: no such setting (the message lists the registered ones).
    """
    try:
        return _SETTINGS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown KV codec {name!r}; registered: {list(_SETTINGS)} (a plugin registers more "
            "with causalkv.caches.codecs.register_codec)"
        ) from None


def _build(name: str, settings: Any) -> tuple[CodecSetting, KVCodec]:
    """The setting ``name`` and its codec from ``settings``, named for the setting."""
    entry = codec_setting(name)
    codec = entry.load().from_settings(settings, **entry.params)
    codec.name = entry.name  # messages name the setting the user typed
    return entry, codec


def make_codec(name: str, settings: Any) -> KVCodec:
    """The codec of setting ``name`` configured from the cache's options record ``settings``
    (``QVGKVQuantArgs``: PRQ reads its centroids, block size, stages...).

    The first use of a setting in a process runs the conformance check on it
    (`causalkv.caches.codecs.conformance.check_first_use`, at a default head_dim unless the
    setting was checked already, e.g. by `codec_problem` at the model's).

    Raises:
        ConfigError: an unknown setting, or one whose target does not import.
        CodecConformanceError: the codec fails the conformance check (now or earlier).
    """
    entry, codec = _build(name, settings)
    from causalkv.caches.codecs.conformance import check_first_use  # torch, as the codec

    check_first_use(codec, entry, settings)
    return codec


def codec_problem(name: str, settings: Any, head_dim: int) -> str | None:
    """Why the codec of setting ``name`` configured from ``settings`` cannot pack K/V of
    ``head_dim`` channels, or None when it can: its layout rule
    (`causalkv.caches.codecs.base.KVCodec.layout_problem`), else the first-use conformance
    check at ``head_dim`` (its message: the codec, the check, the fix). A host's start-up check
    (`causalkv.caches.qvg.options.QVGCodecOptions.layout_problem`) calls it before any weights
    load.

    Raises:
        ConfigError: an unknown setting, or one whose target does not import.
    """
    from causalkv.caches.codecs.conformance import CodecConformanceError, check_first_use

    entry, codec = _build(name, settings)
    problem = codec.layout_problem(head_dim)
    if problem is None:
        try:
            check_first_use(codec, entry, settings, head_dim=head_dim)
        except CodecConformanceError as exc:
            return str(exc)
    return problem


register_codec("int4", "causalkv.caches.codecs.prq.codec:PRQCodec", bits=4,
               help="PRQ: k-means centroids + 4-bit residual with fp8 block scales")
register_codec("int2", "causalkv.caches.codecs.prq.codec:PRQCodec", bits=2,
               help="PRQ: k-means centroids + 2-bit residual with fp8 block scales")
register_codec("fp8", "causalkv.caches.codecs.fp8:FP8Codec",
               help="FP8 e4m3 values with an fp32 scale per token and head")
register_codec("nvfp4", "causalkv.caches.codecs.nvfp4:NVFP4Codec",
               help="NVFP4: e2m1 values, an e4m3 scale per 16 elements, an fp32 scale per segment")
