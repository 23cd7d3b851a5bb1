"""The setting, in vLLM-Omni's conventions: one key of the stage's ``model_config``.

vLLM-Omni passes a pipeline its options through ``OmniDiffusionConfig.model_config`` (a stage's
``model_config:`` in a deploy YAML, or ``Omni(model=..., model_config={...})``); LingBot-World's
own options live there (``lingbot_reuse_last_step_kv``, ``ar_diffusion_height``, ...). causalkv
reads one nested key, `CONFIG_KEY`, holding the QVG settings under causalkv's reference keys::

    model_config:
      causalkv_kv_cache:
        kv_cache_quant: int2            # off | int4 | int2 | fp8 | nvfp4 | a plugin's codec
        kv_cache_quant_keep_recent: 1   # and the other kv_cache_quant_* knobs

Absent key: vLLM-Omni's own cache, nothing changed. Present: causalkv's
`QVGPackedCausalKVCache` holds LingBot-World's self-attention K/V (``kv_cache_quant: off`` keeps
every chunk dense, bit for bit vLLM-Omni's output). The codec names are causalkv's codec
registry's once the process has loaded causalkv's plugins (`read_settings` loads them first,
``causalkv.plugin.collected``: once per process, under the allow and block switches of
causalkv's runtime), so ``kv_cache_quant`` and ``kv_cache_quant_recent_tier`` take a plugin's
codec as they take a built-in one; a served pipeline's registration may name the codec used
when ``kv_cache_quant`` is left out. Torch-free: importing this loads no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from causalkv.caches.qvg.options import QVGKVQuantArgs, quant_choices
from causalkv.errors import ConfigError
from causalkv.plugin import collected

__all__ = ["CONFIG_KEY", "KNOWN_KEYS", "read_settings"]

#: the ``model_config`` key holding causalkv's cache settings
CONFIG_KEY = "causalkv_kv_cache"

#: the keys accepted under `CONFIG_KEY` (causalkv's reference keys, ``kv_cache_quant*``)
KNOWN_KEYS: tuple[str, ...] = tuple(sorted(QVGKVQuantArgs.keys()))


def read_settings(model_config: Mapping[str, Any] | None, *,
                  codec: str | None = None) -> QVGKVQuantArgs | None:
    """The QVG settings asked for in a stage's ``model_config``, or None when it asks none.

    The codec names are the registry's after causalkv's plugins are loaded
    (`causalkv.plugin.collected` on the process-wide manager; only when the key asks for
    something). ``codec``: the served pipeline's registered codec, the ``kv_cache_quant`` of a
    setting that gives none (None: ``kv_cache_quant`` is required).

    Raises `ConfigError` (a ValueError, the error vLLM-Omni's pipelines raise for a bad
    ``model_config`` value) naming the key, the value and the fix, for: a `CONFIG_KEY` that is
    not a mapping, an unknown key under it, a value out of range (``kv_cache_quant: int9``, a
    codec no plugin registered; ``kv_cache_quant_centroids: 0``), or a knob set while
    ``kv_cache_quant`` is off.
    """
    raw = (model_config or {}).get(CONFIG_KEY)
    if raw is None:
        return None
    collected()  # the plugins' codec settings join the registry the keys are read against
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"model_config.{CONFIG_KEY} must be a mapping such as {{kv_cache_quant: int2}}, "
            f"got {raw!r}"
        )
    unknown = sorted(str(k) for k in raw if k not in KNOWN_KEYS)
    if unknown:
        raise ConfigError(
            f"model_config.{CONFIG_KEY} has unknown key(s) {unknown}; the keys are {list(KNOWN_KEYS)}"
        )
    if "kv_cache_quant" not in raw:
        if codec is None:
            raise ConfigError(
                f"model_config.{CONFIG_KEY} must set kv_cache_quant (one of {list(quant_choices())}), "
                f"got {dict(raw)!r}"
            )
        raw = {"kv_cache_quant": codec, **raw}
    try:
        args = QVGKVQuantArgs.from_dict(raw)
        args.check_used()
    except (TypeError, ValueError) as exc:  # ConfigError is a ValueError
        raise ConfigError(f"model_config.{CONFIG_KEY}: {exc}") from None
    return args
