"""Helpers for testing plugins: a fresh manager and a temporary plugin.

    from causalkv.plugin.testing import fresh_plugin_manager, temporary_plugin

    def test_my_cache_is_chosen():
        pm = fresh_plugin_manager()
        with temporary_plugin(pm, my_plugin_module):
            assert resolve("tiny-wan", pm=pm).cache_factory.name == "my-cache"
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

from causalkv.hooks import hookimpl
from causalkv.plugin.manager import CausalKVPluginManager, make_plugin_manager

__all__ = ["RecordsPlugin", "fresh_plugin_manager", "temporary_plugin"]

_counter = itertools.count()


def fresh_plugin_manager(*, builtin: bool = True) -> CausalKVPluginManager:
    """A new manager with the hookspecs and (by default) the built-in plugin, no autoload.

    Installed plugins and the ``CAUSALKV_*`` env vars are ignored, so tests see only what
    they register.
    """
    return make_plugin_manager(autoload=False, env={} if builtin else {"CAUSALKV_DISABLE_PLUGINS": "causalkv.builtin"})


@contextmanager
def temporary_plugin(
    pm: CausalKVPluginManager, plugin: object, name: str | None = None
) -> Iterator[str]:
    """Register ``plugin`` under a unique name for the ``with`` block; unregister in finally.

    Yields the name. Validation errors (a misspelled hook, a wrong argument name) raise.
    """
    name = pm.register_plugin(plugin, name=name or f"temporary-plugin-{next(_counter)}")
    try:
        yield name
    finally:
        pm.unregister(name=name)


class RecordsPlugin:
    """A plugin object returning fixed stage registrations and cache factories.

    ``temporary_plugin(pm, RecordsPlugin(stages=[StageRegistration(...)]))`` registers a stage
    for one test without writing a module.
    """

    def __init__(self, stages: object = (), caches: object = ()) -> None:
        self.stages, self.caches = list(stages), list(caches)  # type: ignore[call-overload]

    @hookimpl
    def causalkv_register_stages(self) -> list:
        return self.stages

    @hookimpl
    def causalkv_register_cache_factories(self) -> list:
        return self.caches
