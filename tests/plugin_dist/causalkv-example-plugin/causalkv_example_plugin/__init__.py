"""Example causalkv plugin: registers a stage and a cache through the public hooks.

- stage ``example-stage`` (``causalkv_example_plugin.stage:ExampleStage``, imported only when
  chosen) serves ``tiny-example`` and ``ExamplePipeline``; it needs the ``example:ring``
  cache feature;
- cache ``example-ring`` builds a dense cache and declares ``example:ring`` besides the
  dense cache's features, so resolution picks it for the example stage.
"""

from causalkv.hooks import CacheFactory, StageRegistration, hookimpl

RING_FEATURE = "example:ring"


def build_ring_cache(spec, quant=None):
    """A cache factory callable: ``(spec: CausalCacheSpec, quant) -> cache``."""
    from causalkv.caches.dense import DenseCausalKVCache

    return DenseCausalKVCache(spec, quant)


@hookimpl
def causalkv_register_stages():
    return [
        StageRegistration(
            "example-stage",
            "causalkv_example_plugin.stage:ExampleStage",
            models=("tiny-example", "ExamplePipeline"),
        )
    ]


@hookimpl
def causalkv_register_cache_factories():
    return [
        CacheFactory(
            "example-ring",
            build_ring_cache,
            capabilities=(
                "pinned_sink",
                "head_slice",
                "recent_window",
                "growth",
                "int_indices",
                RING_FEATURE,
            ),
            priority=5,
        )
    ]
