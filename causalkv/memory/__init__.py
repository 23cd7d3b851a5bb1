"""The KV memory planner behind ``causalkv memory``: exact bytes of a request's caches, no tensors.

For a model's geometry (`ModelGeometry`: a built-in one, `BUILTIN_MODELS`; a causalkv preset
or a local diffusers / sglang folder is read by the runtime,
`causalkv.runtime.model_io.geometry.resolve_model`) and a request
(`MemoryRequest`: video size, frames, CFG, shots), `plan_memory` gives per QVG setting
(`SETTINGS`: ``off``, then per registered codec setting, a plugin's too, ``<codec>-default``
and ``<codec>-recent0``, and the benchmark's ``int2-recent-int4``, ``int2-recent-fp8``,
``int2-sink0``; the names `benchmarks/sglang_bridge.py` uses), and `plan_setting` per any
one `Setting`, the bytes the caches of one stage hold, beside what sglang's dense cache
allocates for the same request, held by one cache (`CacheModel`: `STREAM_CACHE`, causalkv's packed cache;
`ROLLING_SLOT_CACHE`, a cache reproducing a rolling slot buffer's views; the caller maps a host
to one, ``causalkv memory --host``). Nothing is allocated: the bytes of a packed chunk are
`packed_nbytes_formula`'s (the codec's exact stored bytes), which chunk is held is the cache's
own cursor model (`causalkv.caches.positions.PositionModel`: `StreamState`, `RollingSlots`),
which chunk stays dense is its packing policy object's decision (`RECENT_CHUNKS` /
`RECENT_NON_SINK`), and which
cold chunks are packed by which codec, in which spans and with which shared codebook is the
segment store's own tier policy (`causalkv.caches.qvg.tiering.TierPolicy`, the store encodes
what it decides, the planner counts it), so the planner and the caches share one
implementation of every rule.

The memory model (docs/design.md, "Memory math"):

- The chunk being generated is stored by no layer while it is denoised: its denoising passes
  are probes (each call's view is one buffer of the history plus the call's own K/V), and
  its context pass commits it straight to its tier.
- After each chunk's context pass a layer's cache holds context only, already trimmed to what
  the next chunk's advance keeps (the sink, a pinned shot sink, the newest chunks: at most
  ``cache_tokens - chunk_tokens`` tokens), each chunk at its tier: bf16
  (``2 x B x n x H x D x itemsize``), packed at the setting's bits, or, with
  ``recent_tier="int4"``, packed at 4 bits while the policy keeps it for recency (reason
  ``recent``) or as a sink with ``sink=0`` (reason ``sink``); such a chunk is re-packed at the
  main bits when it leaves recency. A chunk is packed only if that stores fewer bytes.
- ``kv_bytes``: the most the caches hold after any chunk's context pass (all layers, all CFG
  sets); ``peak_bytes``: the most held at once over the request: per chunk
  i, the caches (chunk i-1's context during the denoising passes, then layer by layer chunk
  i's during the context pass) plus one call's buffer: a probe's whole window; the commit's,
  with attention ``gathered`` (sglang's), one layer's visible window as one dense buffer
  (``2 x B x visible x H x D x itemsize``; the whole window, ``cache_tokens``, once the
  cache is full), with ``streamed`` (causalkv's `attend`) the largest packed segment
  decoded alone (`_call_buffers` has the caches' exact rules); at most ``kv_bytes`` plus the
  window, equal to it once the window is full and the context no longer changes;
  ``dense_bytes``: sglang's dense cache,
  ``layers x sets x 2 x B x cache_tokens x H x D x itemsize``, allocated whole at the start.

Out of scope: sequence-parallel and head-sliced caches (each rank would hold its heads'
share), the text cross-attention cache, weights and activations.

The modules: `records` (the settings, the request, the cache model record, the stream layout,
byte units), `cache_models` (the caches planned), `geometry` (the planner's view of a model,
the built-in models), `layout` (the request's stream and a cursor model's positions per chunk),
`plan` (bytes per setting: the store's segments modelled as bytes
under the tier policy's decisions; the plan, the budget search). Import the names from this
package.

Below the runtime and the host bridges, above the plugin system (a layers contract in
pyproject.toml): the command line plans with it, and vLLM-Omni's paged engine admits sessions
by it (`causalkv.vllm_omni.admission`).
"""

from __future__ import annotations

from causalkv.lazy import lazy_names

#: each module's names, imported on first use: ``causalkv memory --help`` reads `records` and
#: `geometry` alone (`layout`, `plan` and `cache_models` import the caches' position arithmetic)
_NAMES = {
    "records": ("ATTENTION", "CacheModel", "MemoryRequest", "SETTINGS", "Setting",
                "StreamLayout", "attention_of", "check_budget", "format_bytes", "parse_bytes"),
    "geometry": ("BUILTIN_MODELS", "ModelGeometry", "decoded_frames", "frame_tokens"),
    "cache_models": ("ROLLING_SLOT_CACHE", "STREAM_CACHE"),
    "layout": ("ChunkState", "positions", "stream_layout"),
    "plan": ("MemoryPlan", "SettingPlan", "plan_memory", "plan_setting"),
}
_HOMES = {name: f"causalkv.memory.{module}" for module, names in _NAMES.items() for name in names}


__all__ = sorted(_HOMES)
__getattr__ = lazy_names(__name__, _HOMES)
