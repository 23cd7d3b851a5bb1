"""What the worker's log shows per request: one ``causalkv kv-cache summary:`` line.

A served stage's ``forward`` (`forward`) notes every cache set the request allocates (`track`,
called by the allocation hook; a realtime session's caches through
`prepare_realtime_caches`) and logs, after the request, the peak bytes of the stage's whole
cache set over the request (all blocks and the largest one-call buffer included), the bytes held at the end, what sglang's dense cache allocates for the same
request, packed chunks, pinned shot sink (`summary_line`).

This module imports no sglang and no torch at import time (sglang imports the hooks while it
loads its plugins).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from causalkv.caches.ledger import peak_nbytes
from causalkv.sglang.stages import begin_chunk_loop
from causalkv.sglang.targets import log_once, qualname, served

__all__ = ["forward", "prepare_realtime_caches", "summary_line", "track"]

logger = logging.getLogger(__name__)

_TRACK = "_causalkv_request_caches"


def track(stage: Any, caches: list, line: str) -> list:
    """Log an allocation's line (once per stage and line) and note its caches for the request's
    summary; returns ``caches``."""
    log_once(logger, ("alloc", qualname(stage), line), logging.INFO, "%s", line)
    tracked = stage.__dict__.get(_TRACK)
    if tracked is not None:
        tracked.append(caches)
    return caches


def _nbytes(cache: Any) -> tuple[int | None, int]:
    """(resident, dense) K/V bytes of one sglang cache block."""
    k = getattr(cache, "k", None)
    v = getattr(cache, "v", None)
    if k is not None and v is not None and hasattr(k, "nbytes"):  # sglang's dense buffers
        return int(k.nbytes + v.nbytes), int(k.nbytes + v.nbytes)
    dense = 2 * cache.batch_size * cache.cache_size * cache.num_heads * cache.head_dim * cache.dtype.itemsize
    resident = cache.resident_nbytes() if hasattr(cache, "resident_nbytes") else None
    return (int(resident) if resident is not None else None), int(dense)


def summary_line(stage: Any, cache_sets: Iterable[list]) -> str | None:
    """One ``causalkv kv-cache summary:`` line over the stage's cache sets (positive, CFG).

    ``peak_bytes``: the most the sets held at once over the request: every block's storage
    and the largest one-call buffer (a view gathered for attention or a probe); for sglang's
    own caches, their preallocated buffers. ``resident_bytes``: what they hold now. ``dense_bytes``: what sglang's dense cache allocates for the
    same request. ``ratio``: ``dense_bytes / peak_bytes``, so a request that never packed
    reads 1.00 or less, not a compression. ``codec``: the codec setting of causalkv's cache
    (``int2``, ``fp8``, ...; ``off`` for sglang's own caches), ``recent_tier`` its recency tier.
    """
    sets = [s for s in cache_sets if s]
    if not sets:
        return None
    cls = type(sets[0][0])
    caches = [c for blocks in sets for c in blocks]
    sizes = [_nbytes(c) for c in caches]
    known = all(r is not None for r, _ in sizes)
    resident, dense = sum(r or 0 for r, _ in sizes), sum(d for _, d in sizes)
    markers = {id(m): m for c in caches if (m := getattr(c, "marker", None)) is not None}
    # the ledger of the stage: every block that shares the marker reports to it
    peak = peak_nbytes([m.ledger for m in markers.values()], resident)
    first = sets[0][0]
    packed = first.packed_chunks() if hasattr(first, "packed_chunks") else 0
    pinned = int(getattr(first, "pinned_len", 0) or 0)
    ratio = f"{dense / peak:.2f}" if known and peak else "n/a"
    quant = getattr(first, "quant", None)
    codec = getattr(quant, "codec", None) or "off"
    tier = getattr(quant, "recent_tier", "bf16") if codec != "off" else "bf16"
    return (
        f"causalkv kv-cache summary: stage={type(stage).__name__} cache={cls.__name__} "
        f"codec={codec} recent_tier={tier} "
        f"sets={len(sets)} layers={len(sets[0])} peak_bytes={peak if known else 'n/a'} "
        f"resident_bytes={resident if known else 'n/a'} dense_bytes={dense} ratio={ratio} "
        f"packed_chunks={packed} pinned_tokens={pinned}"
    )


def forward(original: Callable[..., Any], self: Any, batch: Any, server_args: Any):
    """A served stage's ``forward``: after the request, log the caches it used."""
    if not served(self):
        return original(self, batch, server_args)
    self.__dict__[_TRACK] = tracked = []
    begin_chunk_loop(self)
    try:
        out = original(self, batch, server_args)
        held = [*tracked, getattr(self, "causal_kv_cache", None), getattr(self, "causal_kv_cache_neg", None)]
        sets = {id(caches[0]): list(caches) for caches in held if caches}  # each set once, in order
        line = summary_line(self, sets.values())
        if line is not None:
            logger.info("%s", line)
        return out
    finally:
        self.__dict__.pop(_TRACK, None)


def prepare_realtime_caches(original: Callable[..., Any], self: Any, batch: Any,
                            server_args: Any, ctx: Any):
    """``_prepare_realtime_causal_caches``: a realtime session allocates its caches on chunk 0
    and keeps them in the session, not on the stage; note them so each chunk's summary line
    covers the caches the chunk used (packing shows from chunk 1 on)."""
    cache_ctx = original(self, batch, server_args, ctx)
    tracked = self.__dict__.get(_TRACK)
    caches = getattr(cache_ctx, "kv_cache", None)
    if tracked is not None and caches:
        tracked.append(list(caches))
    return cache_ctx
