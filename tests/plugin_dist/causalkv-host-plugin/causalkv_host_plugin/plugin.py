"""The registrations (names only: nothing of sglang or vLLM-Omni is imported here; each
host's bridge imports its classes).

- Two cache factories: ``toy-packed`` builds causalkv's contract (``kind(spec, options)``: causalkv's
  runtime and vLLM-Omni), ``toy-sglang`` sglang's blocks (capability ``host:sglang``: built with
  sglang's allocation keywords). The second declares its capabilities, so listing it imports no
  sglang; the first reads its class's.
- A host class in each host, each with its cache factory and ``toy-codec``'s int8: a subclass of
  sglang's LongLive 2.0 stage (run by the plugin's own sglang pipeline, `sglang_pipeline`), a
  subclass of causalkv's vLLM-Omni LingBot-World pipeline, and, in causalkv's runtime, the
  built-in LongLive 2.0 stage for the preset ``tiny-longlive2`` (its cache named, its codec
  ``--kv-cache-quant``'s).
"""

from causalkv.hooks import CacheFactory, HostClassRegistration, hookimpl


@hookimpl
def causalkv_register_cache_factories():
    return [
        CacheFactory("toy-packed", "causalkv_host_plugin.caches:ToyPackedCache", priority=-1),
        CacheFactory("toy-sglang", "causalkv_host_plugin.sglang_cache:ToySGLangCache",
                     capabilities=("host:sglang", "quant:qvg", "pinned_sink", "growth", "probe_commit")),
    ]


@hookimpl
def causalkv_register_host_classes():
    return [
        HostClassRegistration("sglang", "causalkv_host_plugin.sglang_stage:ToyLongLive2Stage",
                         models="ToyLongLive2Pipeline", codec="int8", cache="toy-sglang"),
        HostClassRegistration("vllm-omni", "causalkv_host_plugin.vllm_omni_pipeline:ToyLingBotWorldPipeline",
                         models="ToyLingBotWorldPipeline", codec="int8", cache="toy-packed"),
        HostClassRegistration("causalkv", "causalkv.stages.longlive2:LongLive2Stage", models="tiny-longlive2",
                         cache="toy-packed"),
    ]
