"""The causalkv plugin contract: the one name, the pluggy markers, records and hookspecs.

No logic and no heavy imports live here (torch only under TYPE_CHECKING): ``import
causalkv.hooks`` never loads torch. Plugin authors need only this module::

    from causalkv.hooks import CacheFactory, StageRegistration, hookimpl

    @hookimpl
    def causalkv_register_stages():
        return [StageRegistration("my-stage", "my_pkg.stage:MyStage", models=["MyPipeline"])]
"""

from causalkv.hooks.markers import ENTRY_POINT_GROUP, ENV_PREFIX, NAME, hookimpl, hookspec
from causalkv.hooks.records import CacheFactory, Preset, StageRegistration, import_object
from causalkv.hooks.specs import (
    causalkv_chunk_done,
    causalkv_configure_stage,
    causalkv_register_cache_factories,
    causalkv_register_stages,
    causalkv_select_cache_factory,
)

#: names of every hook specification, in the order the docs describe them
HOOK_NAMES: tuple[str, ...] = (
    "causalkv_register_stages",
    "causalkv_register_cache_factories",
    "causalkv_select_cache_factory",
    "causalkv_configure_stage",
    "causalkv_chunk_done",
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_PREFIX",
    "HOOK_NAMES",
    "NAME",
    "CacheFactory",
    "Preset",
    "StageRegistration",
    "causalkv_chunk_done",
    "causalkv_configure_stage",
    "causalkv_register_cache_factories",
    "causalkv_register_stages",
    "causalkv_select_cache_factory",
    "hookimpl",
    "hookspec",
    "import_object",
]
