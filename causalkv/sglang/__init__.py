"""The sglang bridge: sglang's causal video stages get causalkv's caches (QVG with pins).

sglang discovers it through the entry point ``causalkv`` in the group
``sglang.multimodal_gen.plugins`` and calls `register` in every worker, the CLI and the HTTP
server. `register` only registers hooks (AROUND wrappers on sglang's stage methods, by
dotted name); sglang applies them with ``apply_plugin_hooks()``, which is when the stage
modules are imported. Importing causalkv, or this package, never imports sglang.

Switches: ``CAUSALKV_SGLANG_BRIDGE=0`` turns the bridge off; sglang's own ``SGLANG_PLUGINS``
allow list (entry-point names) decides whether sglang calls it at all. See docs/sglang.md.
"""

from __future__ import annotations

import logging
import os

__all__ = ["ENV_SWITCH", "ENTRY_POINT_NAME", "register", "enabled"]

logger = logging.getLogger(__name__)

#: environment variable that turns the bridge off (``0``, ``false``, ``off``, ``no``)
ENV_SWITCH = "CAUSALKV_SGLANG_BRIDGE"
#: the entry point's name in sglang's plugin group (what ``SGLANG_PLUGINS`` lists)
ENTRY_POINT_NAME = "causalkv"
_PLUGIN_API = "sglang.multimodal_gen.runtime.platforms.plugins"


def enabled() -> bool:
    """False when ``CAUSALKV_SGLANG_BRIDGE`` is set to 0/false/off/no."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def register() -> bool:
    """sglang's plugin callable: register the bridge's hooks; True when it did.

    Does nothing and logs one line saying why when the bridge is switched off, sglang is not
    installed, or sglang's plugin API is not the one the bridge was written for.
    """
    if not enabled():
        logger.info("causalkv sglang bridge off: %s=%s", ENV_SWITCH, os.environ.get(ENV_SWITCH))
        return False
    try:
        from sglang.multimodal_gen.runtime.platforms.plugins import HookType, plugin_hook
    except ImportError as exc:
        logger.info("causalkv sglang bridge not registered: cannot import %s (%s)", _PLUGIN_API, exc)
        return False
    around = getattr(HookType, "AROUND", None)
    if around is None or not callable(plugin_hook):
        logger.info(
            "causalkv sglang bridge not registered: %s has no plugin_hook/HookType.AROUND", _PLUGIN_API
        )
        return False
    from causalkv.sglang.hooks import HOOKS

    for target, hook in HOOKS:
        plugin_hook(target, type=around)(hook)
    logger.info("causalkv sglang bridge registered %d hooks", len(HOOKS))
    return True
