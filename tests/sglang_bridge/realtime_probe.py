"""Test-environment observer: what the KV caches of a realtime LingBot-World session hold
after every chunk, printed by sglang's worker.

In a realtime session sglang allocates the caches on chunk 0 and keeps them in the session's
``RealtimeCausalDiTState``. This probe reads the session's caches after each chunk and prints
`causalkv.sglang.stages.summary_line` for them plus the stream's cursors (tokens written, the
cache size, quantize calls), from outside the bridge: for stock sglang too, where the bridge
is off, and as a check of the bridge's own per-chunk summary line.

It changes nothing: one AFTER hook, registered through sglang's own ``HookRegistry`` (the
mechanism the bridge's hooks use), on ``_advance_realtime_causal_cache``, which sglang calls
once per chunk with the chunk's cache context. Installed by ``site/sitecustomize.py`` only in
processes started with ``CAUSALKV_TEST_REALTIME_PROBE=1`` (the realtime end-to-end test's
servers), so no other test sees it. Never part of causalkv.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV = "CAUSALKV_TEST_REALTIME_PROBE"
#: every probe line starts with this
PREFIX = "causalkv test probe: "
TARGET = (
    "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.lingbot_world."
    "lingbot_world_causal_denoising.LingBotWorldCausalDMDDenoisingStage."
    "_advance_realtime_causal_cache"
)


def install() -> bool:
    """Register the hook when ``CAUSALKV_TEST_REALTIME_PROBE=1``; True when it did. Not in
    multiprocessing's resource tracker, which runs no stage (importing sglang there would only
    cost each server start two CPU seconds)."""
    if os.environ.get(ENV) != "1" or "multiprocessing.resource_tracker" in " ".join(sys.orig_argv):
        return False
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry, HookType

    HookRegistry.register(TARGET, after_chunk, HookType.AFTER)
    return True


def probe_line(stage: Any, cache_ctx: Any) -> str | None:
    """One probe line for the caches of ``cache_ctx`` (sglang's realtime cache context)."""
    from causalkv.sglang.stages import summary_line

    caches = list(cache_ctx.kv_cache or [])
    line = summary_line(stage, [caches])
    if line is None:
        return None
    first = caches[0]
    calls = getattr(first, "quantize_calls", None)
    return (
        f"{PREFIX}chunk={cache_ctx.chunk_idx} persist={int(bool(cache_ctx.persist_state))} "
        f"tokens_written={int(first.global_end_index.item())} cache_tokens={first.cache_size} "
        f"sink_tokens={first.sink_tokens} quantize_calls={'n/a' if calls is None else calls} "
        f"| {line}"
    )


def after_chunk(result: Any, stage: Any, cache_ctx: Any, *args: Any, **kwargs: Any) -> None:
    """sglang's AFTER hook: print the probe line; the return value is left as it was."""
    line = probe_line(stage, cache_ctx)
    if line is not None:
        print(line, flush=True)
