"""The sglang bridge: sglang's causal video stages get causalkv's caches (QVG with pins).

sglang discovers it through the entry point ``causalkv`` in the group
``sglang.multimodal_gen.plugins`` and calls `register` in every worker, the CLI and the HTTP
server. `register` only registers hooks (AROUND wrappers on sglang's stage methods, by
dotted name); sglang applies them with ``apply_plugin_hooks()``, which is when the stage
modules are imported. Importing causalkv, or this package, never imports sglang.

Switches: ``CAUSALKV_SGLANG_BRIDGE=0`` turns the bridge off (then only an observer hook is
registered, which changes nothing and warns when ``--kv-cache-quant`` is silently dropped);
``CAUSALKV_SGLANG_LINGBOT_QVG=sglang`` keeps sglang's own QVG cache for LingBot-World;
``CAUSALKV_SGLANG_FUSED_ATTENTION=1`` also registers the fused-attention route
(`causalkv.sglang.hooks.FUSED_ATTENTION_HOOKS`, default off);
sglang's own ``SGLANG_PLUGINS`` allow list (entry-point names) decides whether sglang calls
the bridge at all. See docs/sglang.md.

Logging: sglang's workers configure logging after they load plugins, so lines logged here at
registration reach only the main process's log; the lines that matter (which cache serves a
stage, the per-request KV summary, the warnings) are logged at request time, where every
worker's log shows them.
"""

from __future__ import annotations

import logging

from causalkv import env
from causalkv.errors import ConfigError

__all__ = [
    "ENTRY_POINT_NAME",
    "ENV_CODEC",
    "ENV_FUSED_ATTENTION",
    "ENV_LINGBOT_QVG",
    "ENV_RECENT_TIER",
    "ENV_SWITCH",
    "SWITCHES",
    "enabled",
    "register",
]

logger = logging.getLogger(__name__)

#: environment variable that turns the bridge off (a `causalkv.env.flag`: ``0``, ``false``,
#: ``no``, ``off``; default on)
ENV_SWITCH = "CAUSALKV_SGLANG_BRIDGE"
#: which QVG codec serves LingBot-World: ``causalkv`` (default) or ``sglang`` (its own cache)
ENV_LINGBOT_QVG = "CAUSALKV_SGLANG_LINGBOT_QVG"
#: route sglang's causal self-attention over a bridge cache through ``causalkv.caches.attend``
#: on CUDA (``1``/``true``/``on``/``yes``; default off: no GPU run has shown it no slower yet)
ENV_FUSED_ATTENTION = "CAUSALKV_SGLANG_FUSED_ATTENTION"
#: how the bridge holds the keep-recent chunks (and bf16 sink chunks): ``bf16`` (sglang's
#: default) or a codec setting (``int4``, ``fp8``, ...: causalkv's recency tier; sglang's QVG
#: flags have no such field)
ENV_RECENT_TIER = "CAUSALKV_SGLANG_RECENT_TIER"
#: the codec the bridge packs with when sglang's ``--kv-cache-quant`` is on: unset (sglang's
#: int4/int2), or any causalkv codec setting (``fp8``, ``nvfp4``, a plugin's); sglang's flag
#: keeps its own choices and still turns QVG on
ENV_CODEC = "CAUSALKV_SGLANG_CODEC"
#: the entry point's name in sglang's plugin group (what ``SGLANG_PLUGINS`` lists)
ENTRY_POINT_NAME = "causalkv"
_PLUGIN_API = "sglang.multimodal_gen.runtime.platforms.plugins"
#: the bridge's switches the ``causalkv`` command refuses up front when set to another value
#: (`causalkv.env.check_switches`; inside sglang the bridge never raises for them)
SWITCHES = (
    env.Switch(ENV_SWITCH, env.FLAG_VALUES, "0 turns the sglang bridge off, 1 (or unset) keeps it on"),
    env.Switch(ENV_FUSED_ATTENTION, env.FLAG_VALUES,
               "1 routes sglang's attention through causalkv, 0 (or unset) does not"),
    env.Switch(ENV_LINGBOT_QVG, ("causalkv", "sglang"),
               "causalkv (default) or sglang: whose QVG codec serves LingBot-World"),
)


def enabled() -> bool:
    """False when ``CAUSALKV_SGLANG_BRIDGE`` is off (`causalkv.env.flag`); a value it does not
    take keeps the bridge on."""
    return env.flag(ENV_SWITCH, default=True, strict=False)


def register() -> bool:
    """sglang's plugin callable: register the bridge's hooks; True when it did.

    Logs one line saying why and returns False when the bridge is switched off (then it
    registers only `causalkv.sglang.hooks.OFF_HOOKS`, a warning observer), sglang is not
    installed, or sglang's plugin API is not the one the bridge was written for (then it
    registers nothing). `causalkv.sglang.hooks.HOOKS` always, plus
    `causalkv.sglang.hooks.FUSED_ATTENTION_HOOKS` when ``CAUSALKV_SGLANG_FUSED_ATTENTION`` is
    on (a value it does not know: a warning, the route not registered; ``ServerArgs`` refuses
    it at start-up). Never raises for a setting: sglang would drop the whole bridge.
    """
    try:
        off = not env.flag(ENV_SWITCH, default=True)
    except ConfigError:
        off = False
        logger.warning("causalkv: warning: %s=%r is not 0/false/off/no or 1/true/on/yes; the sglang bridge "
                       "stays on (set %s=0 to turn it off)", ENV_SWITCH, env.text(ENV_SWITCH), ENV_SWITCH)
    if off:
        logger.info("causalkv sglang bridge off: %s=%s", ENV_SWITCH, env.text(ENV_SWITCH))
    try:
        # lazy: sglang calls register() from its own plugin loading; importing causalkv.sglang loads no sglang
        from sglang.multimodal_gen.runtime.platforms.plugins import HookType, plugin_hook
    except ImportError as exc:
        missing = f"cannot import {_PLUGIN_API} ({exc})"
    else:
        around = getattr(HookType, "AROUND", None)
        ok = around is not None and callable(plugin_hook)
        missing = None if ok else f"{_PLUGIN_API} has no plugin_hook/HookType.AROUND"
    if missing is not None:
        if not off:
            logger.info("causalkv sglang bridge not registered: %s", missing)
        return False
    # lazy: the hooks' modules are needed only once sglang's plugin API is known to be there
    from causalkv.sglang.hooks import FUSED_ATTENTION_HOOKS, HOOKS, OFF_HOOKS
    from causalkv.sglang.settings import fused_attention

    route = False
    if not off:
        try:
            route = fused_attention()
        except ConfigError as exc:  # refused at start-up by ServerArgs (settings.post_init)
            logger.warning("causalkv sglang bridge: fused-attention route not registered: %s", exc)
    # with the bridge off: an observer that only warns when sglang silently drops --kv-cache-quant
    hooks = OFF_HOOKS if off else HOOKS + (FUSED_ATTENTION_HOOKS if route else ())
    for target, hook in hooks:
        plugin_hook(target, type=around)(hook)
    if not off:
        logger.info("causalkv sglang bridge registered %d hooks%s", len(hooks),
                    f" (fused-attention route: {ENV_FUSED_ATTENTION}=1)" if route else "")
    return not off
