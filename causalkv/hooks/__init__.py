"""The causalkv plugin contract: the one name, the pluggy markers, records and hookspecs.

No logic and no heavy imports live here: ``import causalkv.hooks`` never loads torch, and
nothing here imports a layer above `causalkv.config` (a stage is seen through the `Stage`
protocol, a cache kind through `CacheKind`). Plugin authors need only this module::

    from causalkv.hooks import CacheFactory, StageRegistration, hookimpl

    @hookimpl
    def causalkv_register_stages():
        return [StageRegistration("my-stage", "my_pkg.stage:MyStage", models=["MyPipeline"])]
"""

from causalkv.hooks import specs
from causalkv.hooks.markers import ENTRY_POINT_GROUP, ENV_PREFIX, NAME, hookimpl, hookspec
from causalkv.hooks.records import (
    CacheFactory,
    CacheKind,
    CacheReporting,
    CodecRegistration,
    HostClassRegistration,
    PackingReport,
    Preset,
    Stage,
    StageRegistration,
    import_object,
)

#: names of every hook specification, in the order `causalkv.hooks.specs` defines them
HOOK_NAMES: tuple[str, ...] = tuple(n for n, f in vars(specs).items() if hasattr(f, f"{NAME}_spec"))

__all__ = [
    "ENTRY_POINT_GROUP", "ENV_PREFIX", "HOOK_NAMES", "NAME", "CacheFactory", "CacheKind",
    "CacheReporting", "CodecRegistration", "HostClassRegistration", "PackingReport", "Preset", "Stage",
    "StageRegistration", "hookimpl", "hookspec", "import_object", "specs",
]
