"""The vLLM-Omni bridge: LingBot-World's causal pipeline gets causalkv's self-attention cache.

vLLM-Omni discovers it through the entry point ``causalkv`` in the group
``vllm_omni.general_plugins`` and calls `register` in every process (the main process, the
engine, each diffusion worker) before any model is built (``load_omni_general_plugins``).
`register` calls vLLM-Omni's ``register_diffusion_model`` to replace the built-in
``LingBotWorldCausalDMDPipeline`` with `causalkv.vllm_omni.pipeline.CausalKVLingBotWorldPipeline`
(imported by vLLM-Omni when it builds the pipeline). Importing causalkv, or this package, never
imports vLLM or vLLM-Omni.

The setting is the stage's ``model_config.causalkv_kv_cache`` (`causalkv.vllm_omni.settings`);
without it the replaced pipeline is the stock one. ``CAUSALKV_VLLM_OMNI=0`` turns the bridge off
(nothing registered); vLLM's own ``VLLM_PLUGINS`` allow list decides whether vLLM-Omni calls it
at all. See docs/vllm_omni.md.
"""

from __future__ import annotations

import logging

from causalkv import env

__all__ = ["ENTRY_POINT_NAME", "ENV_SWITCH", "PIPELINE", "enabled", "register"]

logger = logging.getLogger(__name__)

#: environment variable that turns the bridge off (a `causalkv.env.flag`: ``0``, ``false``,
#: ``no``, ``off``; default on)
ENV_SWITCH = "CAUSALKV_VLLM_OMNI"
#: the entry point's name in ``vllm_omni.general_plugins`` (what ``VLLM_PLUGINS`` lists)
ENTRY_POINT_NAME = "causalkv"
#: the vLLM-Omni pipeline the bridge replaces, and the module/class it registers for it
PIPELINE = "LingBotWorldCausalDMDPipeline"
_MODULE, _CLASS = "causalkv.vllm_omni.pipeline", "CausalKVLingBotWorldPipeline"
_REGISTRY = "vllm_omni.diffusion.registry"


def enabled() -> bool:
    """False when ``CAUSALKV_VLLM_OMNI`` is off (`causalkv.env.flag`); a value it does not take
    keeps the bridge on (`register` never raises)."""
    return env.flag(ENV_SWITCH, default=True, strict=False)


def _log_through_vllm() -> None:
    """Send this package's log lines to vLLM's handlers, as vLLM-Omni does with its own logger
    (``vllm_omni/logger.py``), so they show in every vLLM-Omni process's log. Only loggers under
    ``causalkv.vllm_omni``; nothing else of causalkv changes."""
    vllm_root = logging.getLogger("vllm")
    if vllm_root.handlers and logger.parent is not vllm_root:
        logger.parent = vllm_root
        logger.propagate = True


def register() -> bool:
    """vLLM-Omni's general-plugin callable: replace LingBot-World's pipeline; True when it did.

    Returns False quietly (one INFO line) when switched off or when vLLM-Omni is not installed
    or has no ``register_diffusion_model``. Safe to call more than once (vLLM-Omni calls it in
    every process). Never raises: a plugin that raises would stop vLLM-Omni's start-up for a
    reason that is not the user's setting (settings are checked when the pipeline is built).
    """
    _log_through_vllm()
    if not enabled():
        logger.info("causalkv vllm-omni bridge off: %s=%s", ENV_SWITCH, env.text(ENV_SWITCH))
        return False
    try:
        # lazy: vLLM-Omni calls register() from its own plugin loading
        from vllm_omni.diffusion.registry import register_diffusion_model
    except ImportError as exc:
        logger.info("causalkv vllm-omni bridge not registered: cannot import %s (%s)", _REGISTRY, exc)
        return False
    register_diffusion_model(PIPELINE, _MODULE, _CLASS,
                             pre_process_func_name="get_lingbot_world_pre_process_func",
                             post_process_func_name="get_lingbot_world_post_process_func")
    logger.info("causalkv vllm-omni bridge registered: %s -> %s.%s", PIPELINE, _MODULE, _CLASS)
    return True
