"""The vLLM-Omni bridge: LingBot-World's causal pipeline gets causalkv's self-attention cache.

vLLM-Omni discovers it through the entry point ``causalkv`` in the group
``vllm_omni.general_plugins`` and calls `register` in every process (the main process, the
engine, each diffusion worker) before any model is built (``load_omni_general_plugins``).
Which pipelines the bridge serves, and the cache factory building their self-attention caches
(`cache_factory`), is causalkv's plugin registry's answer (`served_pipelines`:
the ``HostClassRegistration`` records of host ``vllm-omni``, collected once per process under
``CAUSALKV_PLUGINS`` and ``CAUSALKV_DISABLE_PLUGINS`` as in causalkv's runtime): `register`
passes each to vLLM-Omni's ``register_diffusion_model`` (with LingBot-World's pre/post-process
functions, which the served class's module exposes) and logs one line naming them. The built-in
plugin's one replaces ``LingBotWorldCausalDMDPipeline`` with
`causalkv.vllm_omni.pipeline.CausalKVLingBotWorldPipeline` (imported by vLLM-Omni when it builds
the pipeline); a plugin may register a subclass of it under a name of its own. Importing
causalkv, or this package, never imports vLLM or vLLM-Omni.

The setting is the stage's ``model_config.causalkv_kv_cache`` (`causalkv.vllm_omni.settings`);
without it the replaced pipeline is the stock one. ``CAUSALKV_VLLM_OMNI=0`` turns the bridge off
(nothing registered); vLLM's own ``VLLM_PLUGINS`` allow list decides whether vLLM-Omni calls it
at all. See docs/vllm_omni.md.
"""

from __future__ import annotations

import logging

from causalkv import env
from causalkv.errors import ConfigError
from causalkv.hooks import CacheFactory, HostClassRegistration
from causalkv.plugin import ResolutionError, collected

__all__ = [
    "DEFAULT_CACHE", "ENTRY_POINT_NAME", "ENV_SWITCH", "HOST", "cache_factory", "enabled", "register",
    "served_pipelines",
]

logger = logging.getLogger(__name__)

#: environment variable that turns the bridge off (a `causalkv.env.flag`: ``0``, ``false``,
#: ``no``, ``off``; default on)
ENV_SWITCH = "CAUSALKV_VLLM_OMNI"
#: the entry point's name in ``vllm_omni.general_plugins`` (what ``VLLM_PLUGINS`` lists)
ENTRY_POINT_NAME = "causalkv"
#: the host name of the registrations this bridge serves (`HostClassRegistration.host`)
HOST = "vllm-omni"
#: the cache factory of a registration that names none (the built-in plugin registers it)
DEFAULT_CACHE = "qvg"
#: LingBot-World's pre/post-process functions, by the name a served class's module exposes them
_PRE, _POST = "get_lingbot_world_pre_process_func", "get_lingbot_world_post_process_func"


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


def served_pipelines() -> dict[str, tuple[HostClassRegistration, str]]:
    """vLLM-Omni ``model_class_name`` -> (the ``HostClassRegistration`` the bridge serves it with,
    its plugin): the highest priority of host ``vllm-omni`` per name, from the registry
    collected once per process (`causalkv.plugin.collected`; a plugin set aside is one warning
    line on stderr and serves nothing). A served class is
    `causalkv.vllm_omni.pipeline.CausalKVLingBotWorldPipeline` or a subclass (the pipeline that
    reads the setting and puts causalkv's store on the DiT), in a module that exposes
    LingBot-World's pre/post-process functions (importing them from that module does)."""
    return collected().host_classes(HOST)


def cache_factory(name: str | None) -> tuple[CacheFactory, str]:
    """The cache factory building the self-attention caches of the pipeline served as ``name``
    (`served_pipelines`: its registration's ``cache``, else `DEFAULT_CACHE`), and its plugin.

    Raises:
        ConfigError: the factory is not registered, or builds another host's caches (its
            ``host:`` capability; the bridge builds causalkv's contract, ``kind(spec, options)``).
    """
    served = served_pipelines().get(name or "")
    cache = served[0].cache if served is not None and served[0].cache else DEFAULT_CACHE
    try:
        entry = collected().cache(cache)
    except ResolutionError as exc:
        raise ConfigError(f"causalkv vllm-omni bridge, {name}: {exc}") from None
    if entry.factory.host is not None:
        raise ConfigError(f"causalkv vllm-omni bridge, {name}: cache {cache!r} (plugin {entry.plugin}) builds "
                          f"{entry.factory.host}'s caches; name a cache built as kind(spec, options)")
    return entry.factory, entry.plugin


def register() -> bool:
    """vLLM-Omni's general-plugin callable: register every served pipeline (`served_pipelines`)
    with vLLM-Omni's ``register_diffusion_model``; True when it registered one. Logs one line
    naming them, with their plugins.

    Returns False quietly (one INFO line) when switched off or when vLLM-Omni is not installed
    or has no ``register_diffusion_model``. Safe to call more than once (vLLM-Omni calls it in
    every process). Never raises for a setting: a plugin that raises would stop vLLM-Omni's
    start-up for a reason that is not the user's setting (settings are checked when the
    pipeline is built); a plugin whose registration fails is set aside by the registry.
    """
    _log_through_vllm()
    if not enabled():
        logger.info("causalkv vllm-omni bridge off: %s=%s", ENV_SWITCH, env.text(ENV_SWITCH))
        return False
    try:
        # lazy: vLLM-Omni calls register() from its own plugin loading
        from vllm_omni.diffusion.registry import register_diffusion_model
    except ImportError as exc:
        logger.info("causalkv vllm-omni bridge not registered: cannot import "
                    "vllm_omni.diffusion.registry (%s)", exc)
        return False
    done = []
    for name, (reg, plugin) in served_pipelines().items():
        module, _, cls = reg.target.partition(":")
        register_diffusion_model(name, module, cls, pre_process_func_name=_PRE, post_process_func_name=_POST)
        codec = f", codec {reg.codec}" if reg.codec else ""
        done.append(f"{name} -> {module}.{cls} (plugin {plugin}, cache {reg.cache or DEFAULT_CACHE}{codec})")
    logger.info("causalkv vllm-omni bridge registered: %s",
                "; ".join(done) or f"nothing (no plugin registers a {HOST} pipeline)")
    return bool(done)
