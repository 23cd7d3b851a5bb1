"""The bridge's settings: sglang's QVG flags, causalkv's environment settings, and the one conversion.

sglang's ``--kv-cache-quant*`` flags give sglang's ``QVGKVQuantArgs`` (`sglang_quant_args`
also takes a dict); causalkv's own settings come from the environment (`read_env`:
``CAUSALKV_SGLANG_RECENT_TIER``, ``CAUSALKV_SGLANG_CODEC``; `lingbot_codec` and
`fused_attention` for the two switches). `bridge_args` turns both into causalkv's
`QVGKVQuantArgs`: the one conversion, made once per request (the stage carries the result,
`causalkv.sglang.stages.request_args`) and once per start-up check.

Settings are checked where they enter: ``ServerArgs.__post_init__`` (`post_init`: start-up in
the user's process, when the model folder is local) and the pipeline's ``_load_config``
(`load_config`: in the worker, before any weight loads) convert a dict
``kv_cache_quant_config`` to sglang's ``QVGKVQuantArgs`` and refuse, with one `ConfigError`
naming the flag and the fix, settings causalkv's codec cannot pack for that model (centroids,
block size x bits, head_dim), and environment settings the bridge does not know.

The codec names are causalkv's codec registry's, read after this process has loaded causalkv's
plugins (`causalkv.plugin.collected`: ``causalkv.plugin.collect`` once per process, under the
allow and block switches of causalkv's runtime), so ``CAUSALKV_SGLANG_CODEC`` and
``CAUSALKV_SGLANG_RECENT_TIER`` take a plugin's codec as they take a built-in one. Which
pipelines are checked is the registry's too (`causalkv.sglang.targets.served_stages`), and a
served stage's registration may name the codec it packs with when ``CAUSALKV_SGLANG_CODEC`` is
unset.

This module imports no sglang at import time (sglang imports the hooks while it loads its
plugins): sglang's and the bridge cache's modules are imported inside the functions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from causalkv.caches.codecs import codec_names
from causalkv.caches.qvg.options import QVGKVQuantArgs as CausalKVQuantArgs
from causalkv.caches.qvg.options import recent_tiers
from causalkv.env import choice, flag
from causalkv.errors import ConfigError, is_int
from causalkv.plugin import collected
from causalkv.sglang import ENV_CODEC, ENV_FUSED_ATTENTION, ENV_LINGBOT_QVG, ENV_RECENT_TIER
from causalkv.sglang.targets import served_stages

__all__ = [
    "EnvSettings",
    "bridge_args",
    "check_settings",
    "fused_attention",
    "lingbot_codec",
    "load_config",
    "normalize",
    "post_init",
    "read_env",
    "sglang_quant_args",
]


# ---- causalkv's settings in the environment -------------------------------------------------
@dataclass(frozen=True)
class EnvSettings:
    """causalkv's own settings of the bridge's cache (sglang's QVG flags have no such fields).

    ``recent_tier``: how the keep-recent chunks (and bf16 sink chunks) are held, ``bf16``
    (sglang's layout) or a codec setting. ``codec``: the codec the bridge packs with while
    sglang's ``--kv-cache-quant`` (int4, int2) turns QVG on; None: sglang's bits.
    """

    recent_tier: str = "bf16"
    codec: str | None = None


def read_env(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """``CAUSALKV_SGLANG_RECENT_TIER`` and ``CAUSALKV_SGLANG_CODEC``, each read once
    (`causalkv.env.choice`), each taking every registered codec setting (causalkv's plugins
    loaded first: `causalkv.plugin.collected`).

    Raises:
        ConfigError: a value the bridge does not know, naming the variable and the choices.
    """
    collected()
    tier = choice(
        ENV_RECENT_TIER, recent_tiers(), default="bf16", environ=environ,
        meaning="a codec: the bridge packs the keep-recent chunks, and bf16 sink chunks, with it "
                "until they are packed with the cache's codec",
    )
    codec = choice(
        ENV_CODEC, codec_names(), default=None, environ=environ,
        meaning="the codec the bridge packs with while --kv-cache-quant int4/int2 turns QVG on",
    )
    return EnvSettings(recent_tier=tier, codec=codec)


def lingbot_codec() -> str:
    """``CAUSALKV_SGLANG_LINGBOT_QVG`` (default ``causalkv``); ConfigError for another value."""
    return choice(
        ENV_LINGBOT_QVG, ("causalkv", "sglang"), default="causalkv",
        meaning="causalkv: the bridge's QVG cache; sglang: sglang's own QVGPackedCausalKVCache "
                "with quant-videogen",
    )


def fused_attention() -> bool:
    """``CAUSALKV_SGLANG_FUSED_ATTENTION`` (`causalkv.env.flag`, default off); ConfigError for a
    value a switch does not take."""
    return flag(
        ENV_FUSED_ATTENTION, default=False,
        meaning="1 routes sglang's causal self-attention over causalkv's cache through "
                "causalkv.caches.attend on CUDA, 0 (the default) keeps sglang's attention over "
                "the materialized window",
    )


# ---- sglang's settings, and the one conversion ----------------------------------------------
def sglang_quant_args(value: Any) -> Any:
    """sglang's ``QVGKVQuantArgs`` for a ``kv_cache_quant_config`` value (converted if a dict).

    A dict takes sglang's field names (``bits`` also as ``"int2"``/``"int4"``/``"off"``) or its
    flag names (``kv_cache_quant``, ``kv_cache_quant_<field>``). Raises ConfigError for anything
    else, an unknown key, or a value sglang refuses.
    """
    # lazy: no sglang import at this module's import (module docstring)
    from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs

    if isinstance(value, QVGKVQuantArgs):
        return value
    if value is None:
        return QVGKVQuantArgs()
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"kv_cache_quant_config must be sglang's QVGKVQuantArgs or a dict, got "
            f"{type(value).__name__}; e.g. kv_cache_quant_config={{'bits': 2}}"
        )
    names = [f.name for f in fields(QVGKVQuantArgs)]
    try:
        flags = [str(k).startswith("kv_cache_quant") for k in value]
        if any(flags):
            if not all(flags):
                raise ConfigError("mixes flag names (kv_cache_quant*) and field names")
            return QVGKVQuantArgs.from_dict(dict(value))
        unknown = sorted(set(map(str, value)) - set(names))
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown}; valid keys: {names}")
        kw = dict(value)
        bits = kw.get("bits")
        if isinstance(bits, str):
            collected()  # a plugin's codec name is pointed at CAUSALKV_SGLANG_CODEC below
            kw["bits"] = CausalKVQuantArgs.from_codec_name(bits).bits
            if kw["bits"] is None and bits.lower() not in ("off", "none"):
                raise ConfigError(
                    f"sglang's bits take off, int4 or int2, got {bits!r}; causalkv's other "
                    f"codecs come through {ENV_CODEC}={bits} (with bits int4 or int2)"
                )
        return QVGKVQuantArgs(**kw).validate()
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"kv_cache_quant_config={dict(value)!r}: {exc}") from None


def normalize(server_args: Any) -> Any:
    """Replace a dict ``server_args.kv_cache_quant_config`` by sglang's args; return them."""
    quant = getattr(server_args, "kv_cache_quant_config", None)
    args = sglang_quant_args(quant)
    if args is not quant:
        server_args.kv_cache_quant_config = args
    return args


def bridge_args(quant: Any, env: EnvSettings | None = None, *,
                codec: str | None = None) -> CausalKVQuantArgs:
    """causalkv's settings for sglang's ``quant`` (its ``QVGKVQuantArgs``) and causalkv's
    environment settings (``env``; default: `read_env`, so each variable is read once here):
    sglang's shared fields, the recency tier, and the codec (``env.codec``, else ``codec``, the
    served stage's registered codec, else sglang's bits).

    The bridge's one conversion: once per request (`causalkv.sglang.stages.request_args`
    carries the result to the allocations) and once per start-up check (`check_settings`).

    Raises:
        ConfigError: a bad environment setting, or settings causalkv refuses.
    """
    env = read_env() if env is None else env
    # lazy: cache imports sglang (module docstring)
    from causalkv.sglang.cache import causalkv_quant_args

    args = causalkv_quant_args(quant, env.recent_tier)
    codec = env.codec or codec
    if codec is not None and args.enabled and codec != args.codec:
        args = replace(args, codec=codec).validate()
    return args


# ---- the start-up checks --------------------------------------------------------------------
def check_settings(pipeline_name: str | None, quant: Any, head_dim: int | None,
                   env: EnvSettings | None = None) -> None:
    """Refuse QVG settings the bridge's codec cannot pack for this pipeline (ConfigError).

    ``quant`` is sglang's ``QVGKVQuantArgs``, ``env`` causalkv's settings (default: read from
    the environment). Resolves what the bridge serves first (`served_stages`: once per
    process, logged); pipelines it does not serve, quant off, and LingBot-World (or a served
    subclass of its stage) with ``CAUSALKV_SGLANG_LINGBOT_QVG=sglang`` are not checked
    (sglang's own code decides there). A ``head_dim`` the codec cannot lay out (the codec's
    layout rule: PRQ's block size of partial bytes, or one that does not divide it) is refused
    except for LingBot-World, where sglang's own QVG cache takes over (said in the log).
    """
    stage = served_stages().get(pipeline_name or "")
    if stage is None or quant is None or not quant.enabled:
        return
    if stage.lingbot and lingbot_codec() == "sglang":
        return
    try:
        args = bridge_args(quant, env, codec=stage.registration.codec)
        args.check_used()
        if head_dim is not None and not stage.lingbot:
            args.check_layout(head_dim)
    except ConfigError as exc:
        raise ConfigError(f"causalkv sglang bridge, {pipeline_name}: {exc}") from None


def model_head_dim(model_dir: str | os.PathLike | None) -> int | None:
    """``attention_head_dim`` of the folder's ``transformer/config.json`` (no weights read)."""
    if not model_dir:
        return None
    try:
        config = json.loads((Path(model_dir) / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    head_dim = config.get("attention_head_dim")
    return head_dim if is_int(head_dim) else None


def post_init(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """``ServerArgs.__post_init__``: a dict ``kv_cache_quant_config`` becomes sglang's args, and
    the settings are checked at start-up when the pipeline and a local model folder are known
    (causalkv's environment settings always, each read once)."""
    fused_attention()
    env = read_env()
    quant = normalize(self)
    out = original(self, *args, **kw)
    if quant.enabled and os.path.isdir(str(getattr(self, "model_path", "") or "")):
        name = getattr(self, "pipeline_class_name", None) or _pipeline_name_of(self)
        check_settings(name, quant, model_head_dim(self.model_path), env)
    return out


def _pipeline_name_of(server_args: Any) -> str | None:
    try:
        # lazy: no sglang import at this module's import (module docstring)
        from sglang.multimodal_gen.registry import get_model_info

        info = get_model_info(server_args.model_path, server_args.backend, server_args.model_id)
    except Exception:  # noqa: BLE001 - resolution errors are sglang's to report, later
        return None
    return getattr(getattr(info, "pipeline_cls", None), "pipeline_name", None)


def load_config(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """``ComposedPipelineBase._load_config`` (the pipeline's first step, before any weights):
    convert and check the QVG settings against the model's ``head_dim``."""
    out = original(self, *args, **kw)
    server_args = getattr(self, "server_args", None)
    if server_args is not None:
        check_settings(getattr(self, "pipeline_name", None), normalize(server_args),
                       model_head_dim(self.model_path))
    return out
