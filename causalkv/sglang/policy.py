"""sglang's QVG packing rule as a pure function (no sglang import).

sglang's packed cache keeps the newest ``keep_recent_chunks`` completed *non-sink* chunks
dense and packs every older one; a completed sink chunk (one that started inside the
stream-start sink) is packed at once when ``sink`` is on, except the protected leading ones
(``sink_keep_chunks``). causalkv's default rule counts sink chunks inside ``keep_recent``
instead; `QVGPackedCausalKVCache(policy="sglang")` and the bridge's cache both use this one.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["sglang_dense_chunks"]


def sglang_dense_chunks(
    completed: Iterable[tuple[int, bool, bool]], keep_recent: int, pack_sink: bool
) -> set[int]:
    """Ids of the completed chunks that stay dense under sglang's rule.

    Args:
        completed: ``(chunk_id, is_sink, protected)`` for every completed chunk still held,
            oldest first; ``protected`` marks a sink chunk among the leading kept ones.
        keep_recent: ``keep_recent_chunks``.
        pack_sink: the quant args' ``sink`` flag.
    """
    completed = list(completed)
    nonsink = [c for c, is_sink, _ in completed if not is_sink]
    keep = set(nonsink[len(nonsink) - keep_recent:]) if keep_recent > 0 else set()
    for c, is_sink, protected in completed:
        if is_sink and (not pack_sink or protected):
            keep.add(c)
    return keep
