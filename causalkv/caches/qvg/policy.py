"""Packing policies: which completed chunks of a QVG segment store stay dense, as objects.

The segment store (`causalkv.caches.qvg.store.SegmentStore`) asks its policy once per advance
which completed chunks it holds must stay dense now, and which sink chunks are packed
together as one span; everything else is packed (once, and only if that stores fewer bytes).
A host only describes its chunks (`ChunkInfo`: where each one sits and whether it holds
stream-start sink or pinned shot-sink tokens, by the host's own position bookkeeping); the
rule is the policy's:

- `RecentChunksPolicy` (`RECENT_CHUNKS`, "recent-chunks"): keep-recent over all completed chunks. The newest ``keep_recent_chunks`` completed
  chunks stay dense, sink chunks included; ``sink=True`` packs sink chunks too (one chunk at a
  time, or, with ``sink_span="full"``, the stream-start sink and the pinned shot sink each as
  one span once all of it is cold), except the leading ``sink_keep_chunks``; ``sink=False``
  keeps every sink chunk dense.
- `RecentNonSinkPolicy` (`RECENT_NON_SINK`, "recent-non-sink"): keep-recent over non-sink chunks: the newest
  ``keep_recent_chunks`` completed *non-sink* chunks stay dense; a completed sink chunk is
  packed at once unless ``sink=False`` or it starts before ``sink_keep_chunks`` chunks of
  the stream's first chunk size. Pinned shot-sink chunks count as sink chunks (``sink=False``
  keeps them dense, as the other rule does). A host whose stock packed cache follows this rule
  uses it to match that cache chunk for chunk.

Policies are named by the rule they decide, never by a host: a cache takes a policy object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.errors import ConfigError

__all__ = [
    "RECENT_CHUNKS",
    "DENSE_REASONS",
    "NON_FINITE",
    "REWRITTEN",
    "RECENT_NON_SINK",
    "RecentChunksPolicy",
    "ChunkInfo",
    "PackingDecision",
    "PackingPolicy",
    "RecentNonSinkPolicy",
    "resolve_policy",
]

# Why a completed chunk is held dense (the keys of `PackingReport.chunks_dense`).
RECENT = "recent"  # one of the newest keep_recent_chunks
SINK_KEEP = "sink_keep"  # one of the leading sink_keep_chunks sink chunks
SINK = "sink"  # a sink chunk with sink=False
WAITING = "waiting for span"  # its span (span_chunks, or the whole sink with "full") is not cold yet
NOT_SMALLER = "not smaller than dense"  # packing it would not save bytes
QUANT_OFF = "quant off"  # quantization is off
POLICY = "policy"  # kept by a policy rule not named above
NON_FINITE = "non-finite"  # its K/V hold NaN or inf: kept as the dense cache keeps them
REWRITTEN = "rewritten in part"  # a write into part of it once packed: never packed twice
DENSE_REASONS = (RECENT, SINK_KEEP, SINK, WAITING, NOT_SMALLER, QUANT_OFF, POLICY, NON_FINITE,
                 REWRITTEN)


@dataclass(frozen=True)
class ChunkInfo:
    """One completed chunk the store holds, as the host sees it.

    Attributes:
        index: the chunk's index (chunks are numbered in the order they were written).
        start, end: the global positions of what is held of it (``[start, end)``).
        sink: it holds stream-start sink tokens (the host's sink prefix).
        pinned: it holds pinned shot-sink tokens.
    """

    index: int
    start: int
    end: int
    sink: bool = False
    pinned: bool = False


@dataclass(frozen=True)
class PackingDecision:
    """What a policy decided for one advance.

    Attributes:
        dense: chunk index -> why it stays dense now (one of ``DENSE_REASONS``).
        groups: sets of chunk indices packed as one span, once every chunk of the set is
            cold (a set naming the current chunk is still open, so it waits).
    """

    dense: Mapping[int, str] = field(default_factory=dict)
    groups: tuple[frozenset[int], ...] = ()


class PackingPolicy(ABC):
    """Which completed chunks stay dense (see the module docstring). Stateless; hashable."""

    #: short name (``QVGPackedCausalKVCache(policy=...)`` accepts it as a spelling)
    name: str = ""

    @abstractmethod
    def decide(
        self,
        quant: QVGKVQuantArgs,
        chunks: tuple[ChunkInfo, ...],
        current: int,
        *,
        sink_open: bool,
        chunk_tokens: int,
    ) -> PackingDecision:
        """The decision for completed ``chunks`` (ascending position), ``current`` the index of
        the chunk being written; ``sink_open``: the stream-start sink reaches into the current
        chunk; ``chunk_tokens``: tokens of the stream's first chunk."""


@dataclass(frozen=True)
class RecentChunksPolicy(PackingPolicy):
    """Keep-recent over all completed chunks (the module docstring); `RECENT_CHUNKS` is the instance."""

    name: str = "recent-chunks"

    def decide(self, quant, chunks, current, *, sink_open, chunk_tokens):
        q = quant
        dense = {c: RECENT for c in range(current - q.keep_recent_chunks, current)}
        prefix = [c.index for c in chunks if c.sink]
        if sink_open:  # the sink is still being written: its group is open
            prefix.append(current)
        pinned = [c.index for c in chunks if c.pinned]
        if not q.sink:
            for c in (*prefix, *pinned):
                dense.setdefault(c, SINK)
            return PackingDecision(dense)
        for c in prefix[: q.sink_keep_chunks]:
            dense.setdefault(c, SINK_KEEP)
        groups = tuple(frozenset(g) for g in (prefix, pinned) if g) if q.sink_span == "full" else ()
        return PackingDecision(dense, groups)


@dataclass(frozen=True)
class RecentNonSinkPolicy(PackingPolicy):
    """Keep-recent over non-sink chunks (the module docstring); `RECENT_NON_SINK` is the instance."""

    name: str = "recent-non-sink"

    def decide(self, quant, chunks, current, *, sink_open, chunk_tokens):
        q = quant
        protect = q.sink_keep_chunks * max(1, chunk_tokens)  # sink chunks starting below stay
        nonsink = [c.index for c in chunks if not (c.sink or c.pinned)]
        recent = set(nonsink[len(nonsink) - q.keep_recent_chunks:]) if q.keep_recent_chunks > 0 else set()
        dense = {}
        for c in chunks:
            if c.index in recent:  # non-sink chunks only
                dense[c.index] = RECENT
            elif (c.sink or c.pinned) and not q.sink:
                dense[c.index] = SINK
            elif c.sink and c.start < protect:
                dense[c.index] = SINK_KEEP
        return PackingDecision(dense)


RECENT_CHUNKS = RecentChunksPolicy()
RECENT_NON_SINK = RecentNonSinkPolicy()
_BY_NAME = {p.name: p for p in (RECENT_CHUNKS, RECENT_NON_SINK)}


def resolve_policy(policy: PackingPolicy | str) -> PackingPolicy:
    """A policy object; the names ``"recent-chunks"``/``"recent-non-sink"`` are accepted spellings."""
    if isinstance(policy, PackingPolicy):
        return policy
    if isinstance(policy, str) and policy in _BY_NAME:
        return _BY_NAME[policy]
    raise ConfigError(
        f"QVGPackedCausalKVCache policy must be a PackingPolicy or one of "
        f"{sorted(_BY_NAME)}, got {policy!r}"
    )
