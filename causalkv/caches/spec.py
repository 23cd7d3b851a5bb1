"""The cache contract: spec, view, capabilities, errors and the `CausalKVCache` protocol.

Layout convention for this package: cache tensors are ``[B, S, H, D]`` (batch, tokens,
heads, head_dim), matching the reference runtime's ``[B, seq, heads, dim]`` K/V layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from causalkv.caches.intervals import Intervals, count, to_positions
from causalkv.capabilities import CacheCapabilities
from causalkv.errors import CausalKVError, ConfigError, UsageError, check_int, is_int

__all__ = [
    "CacheProtocolError",
    "CacheReadError",
    "CacheWriteError",
    "CausalAttentionKVView",
    "CausalKVCache",
    "CausalCacheSpec",
]

class CacheWriteError(CausalKVError, ValueError):
    """A write (or pin) that breaks the cache contract. The cache is left exactly as it was."""


class CacheReadError(CausalKVError, RuntimeError):
    """A view's K/V cannot be produced for the positions it reports (the cache no longer holds
    them): the read is refused rather than answered over fewer or other tokens. The cache is
    left exactly as it was."""


class CacheProtocolError(UsageError):
    """A caller broke a promise it made (a `causalkv.caches.passes.CommitPass` told a host cache
    whose cursor cannot follow the commit the next chunk's size or pin, and the next call
    differs). The call is refused and the cache is left exactly as it was; the message names
    the positions and the fix. A caller that makes no promise never sees this error."""


@dataclass(frozen=True)
class CausalCacheSpec:
    """Shape and policy of one layer's causal KV cache.

    Args:
        batch_size: B.
        num_heads: H, the heads this cache holds (a head-sharded rank holds its slice only).
        head_dim: D.
        cache_size: tokens retained at most (sink and pinned shot sink included).
        sink_tokens: tokens of the sink when no shot sink is pinned (``[0, sink_tokens)``),
            and the most tokens a pin keeps.
        global_sink_tokens: the sink kept at the stream start while a shot sink is pinned.
        attention_window_size: tokens attention sees at most (sink included);
            ``None`` means ``cache_size``.
        dtype, device: of the stored K/V; writes must match exactly.
        allow_growth: grow the buffer instead of failing when sink plus a chunk exceed
            ``cache_size``.
        head_offset: global index of this cache's first head (a head-sharded rank caching
            heads ``[head_offset, head_offset + num_heads)``; 0 on one process). A cache whose
            storage depends on the head (the packed cache's k-means seeds) keys it by the
            global index, so a slice stores exactly what one process stores for those heads.
    """

    batch_size: int
    num_heads: int
    head_dim: int
    cache_size: int
    sink_tokens: int = 0
    global_sink_tokens: int = 0
    attention_window_size: int | None = None
    dtype: torch.dtype = torch.bfloat16
    device: str | torch.device = "cpu"
    allow_growth: bool = False
    head_offset: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_heads", "head_dim", "cache_size"):
            check_int(f"CausalCacheSpec.{name}", getattr(self, name), minimum=1)
        for name in ("head_offset", "sink_tokens", "global_sink_tokens"):
            check_int(f"CausalCacheSpec.{name}", getattr(self, name))
        w = self.attention_window_size
        if w is not None:
            check_int("CausalCacheSpec.attention_window_size", w, minimum=1, hint="or None")
        for name, bound in (("sink_tokens", "cache_size"), ("global_sink_tokens", "cache_size"),
                            ("global_sink_tokens", "sink_tokens"),
                            ("attention_window_size", "cache_size")):
            value, limit = getattr(self, name), getattr(self, bound)
            if value is not None and value > limit:
                raise ConfigError(f"CausalCacheSpec.{name}={value} exceeds {bound}={limit}; "
                                  f"raise {bound} or lower {name}")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"CausalCacheSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        torch.device(self.device)  # raises on a malformed device string

    @property
    def window(self) -> int:
        """The attention window in tokens (``attention_window_size`` or ``cache_size``)."""
        return self.cache_size if self.attention_window_size is None else self.attention_window_size

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def dense_nbytes(self, tokens: int | None = None) -> int:
        """Bytes of K and V for ``tokens`` tokens (default ``cache_size``) in ``dtype``."""
        t = self.cache_size if tokens is None else tokens
        return 2 * self.batch_size * t * self.num_heads * self.head_dim * self.dtype.itemsize


if TYPE_CHECKING:
    from causalkv.caches.codecs.base import PackedRecord
    from causalkv.caches.passes import CommitPass

KVSegment = tuple[torch.Tensor, torch.Tensor]
#: one visible piece as stored: dense K/V ``[B, s, h, D]``, or packed K/V ``[B, h, s, D]``
StoredSegment = KVSegment | tuple["PackedRecord", "PackedRecord"]


class CausalAttentionKVView:
    """What attention sees: the visible K/V in ascending global position.

    Attributes:
        k, v: ``[B, visible, h, D]`` (``h`` = heads of the write's head slice). A cache may
            build them lazily: they are materialized on first access only.
        positions: int64 ``[visible]``, the global positions of the visible tokens.
        position_ranges: the same as half-open ``(start, end)`` runs.
        local_start_index, local_end_index: slots of the current chunk in the cache's
            token buffer (reference-runtime cursors).
        visible_local_end: slot just past the newest visible token.
        visible_global_end: global position just past the newest visible token.
    """

    __slots__ = (
        "_k",
        "_v",
        "_materialize",
        "_segments",
        "_stored",
        "position_ranges",
        "local_start_index",
        "local_end_index",
        "visible_local_end",
        "visible_global_end",
        "_positions",
        "_device",
    )

    def __init__(
        self,
        *,
        position_ranges: Intervals,
        local_start_index: int,
        local_end_index: int,
        visible_local_end: int,
        visible_global_end: int,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        segments: Callable[[], Iterator[KVSegment]] | None = None,
        materialize: Callable[[], KVSegment] | None = None,
        stored: Callable[[], Iterator[StoredSegment]] | None = None,
        device: torch.device | None = None,
    ) -> None:
        if (k is None) != (v is None):
            raise ConfigError("CausalAttentionKVView needs both k and v, or neither")
        if k is None and materialize is None:
            raise ConfigError("CausalAttentionKVView needs k/v or a materialize callable")
        self._k, self._v = k, v
        self._materialize = materialize
        self._segments = segments
        self._stored = stored
        self.position_ranges = tuple(position_ranges)
        self.local_start_index = local_start_index
        self.local_end_index = local_end_index
        self.visible_local_end = visible_local_end
        self.visible_global_end = visible_global_end
        self._positions: torch.Tensor | None = None
        self._device = device if device is not None else (k.device if k is not None else None)

    def _ensure(self) -> None:
        if self._k is None:
            self._fill()

    @torch.compiler.disable(reason="filling k/v decodes the cache's segments (Python); one break")
    def _fill(self) -> None:
        k, v = self._materialize()
        self._check_rows(k.shape[1], "k/v")
        self._k, self._v = k, v

    @property
    def is_materialized(self) -> bool:
        return self._k is not None

    @property
    def k(self) -> torch.Tensor:
        self._ensure()
        return self._k  # type: ignore[return-value]

    @property
    def v(self) -> torch.Tensor:
        self._ensure()
        return self._v  # type: ignore[return-value]

    @property
    def num_visible(self) -> int:
        return count(self.position_ranges)

    @property
    def num_rows(self) -> int:
        """Rows the K/V have (``k.shape[1]``): the visible tokens (a host view may add rows)."""
        return self.num_visible

    def _check_rows(self, rows: int, what: str) -> None:
        """`CacheReadError` unless ``rows`` is what the view reports: a view never answers
        over fewer (or more) tokens than its positions."""
        if rows != self.num_rows:
            raise CacheReadError(
                f"view {what}: {rows} rows for {self.num_rows} reported "
                f"(positions {list(self.position_ranges)}); the cache does not hold what the "
                "view claims, so the read is refused"
            )

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            self._positions = to_positions(self.position_ranges, device=self._device)
        return self._positions

    def iter_segments(self) -> Iterator[KVSegment]:
        """Yield the visible K/V as ``([B, s, h, D], [B, s, h, D])`` pieces in order.

        Dense caches yield slices of their buffer; the packed cache dequantizes one
        segment at a time, so a consumer (``causalkv.caches.attend``) never holds the whole
        window densely.
        """
        if self._k is None and self._segments is not None:
            yield from self._counted(self._segments(), "segments")
        else:
            yield self.k, self.v

    def iter_stored_segments(self) -> Iterator[StoredSegment]:
        """Yield the visible K/V in order as the cache stores them, nothing decoded.

        A dense piece is ``([B, s, h, D], [B, s, h, D])`` views of the cache's buffers; a
        packed piece is its K and V codec record (`causalkv.caches.codecs.base.PackedRecord`)
        ``[B, h, s, D]``, sliced to the view's heads and visible tokens (views, no copy). The
        fused attention path (``causalkv.caches.attend`` on CUDA) reads packed pieces with
        their record type's attention kernel where it has one. A view without packed storage yields what `iter_segments` yields.
        """
        if self._k is None and self._stored is not None:
            yield from self._counted(self._stored(), "stored segments")
        else:
            yield from self.iter_segments()

    def _counted(self, pieces: Iterator[StoredSegment], what: str) -> Iterator[StoredSegment]:
        """``pieces`` as they come, refused (`_check_rows`) as soon as they hold more rows than
        the view reports, or at the end fewer."""
        rows = 0
        for k, v in pieces:
            rows += k.shape[1] if isinstance(k, torch.Tensor) else k.shape[2]
            if rows > self.num_rows:
                self._check_rows(rows, what)
            yield k, v
        self._check_rows(rows, what)

    def __repr__(self) -> str:
        return (
            f"CausalAttentionKVView(positions={list(self.position_ranges)}, "
            f"local=[{self.local_start_index}, {self.local_end_index}), "
            f"visible_local_end={self.visible_local_end}, "
            f"visible_global_end={self.visible_global_end}, materialized={self.is_materialized})"
        )


@runtime_checkable
class CausalKVCache(Protocol):
    """The contract every causal KV cache honours (see docs/caches.md)."""

    spec: CausalCacheSpec

    @property
    def capabilities(self) -> CacheCapabilities: ...

    @property
    def num_cache_heads(self) -> int: ...

    @property
    def global_end(self) -> int: ...

    def update_and_get_attention_kv(
        self,
        *,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
        debug_name: str = "kv_cache",
        probe: bool = False,
        commit: CommitPass | None = None,
    ) -> CausalAttentionKVView:
        """Write ``key``/``value`` ``[B, n, h, D]`` for the chunk starting at
        ``current_chunk_start`` (rewrite or advance) and return the attention view.

        ``probe=True`` marks a probe (a denoising pass of the chunk being generated): the same
        view, and nothing stored or changed, so a later call sees what it would have seen
        without it. ``commit`` marks the chunk's context pass (`causalkv.caches.passes`):
        stored, then only what the next advance keeps stays (`StreamState.committed`)."""
        ...

    def get_attention_kv(
        self,
        *,
        cache_head_start: int | None = None,
        num_heads: int | None = None,
        recent_window_tokens: int | None = None,
    ) -> CausalAttentionKVView:
        """The view of the current state without writing."""
        ...

    def visible_positions(self, *, recent_window_tokens: int | None = None) -> Intervals:
        """The positions the view would show now, as ascending runs, without reading K/V."""
        ...

    def reset_indices(self) -> None: ...

    def pin_current_chunk(self, current_num_tokens: int) -> None: ...

    def can_direct_current_attention(self, num_new_tokens: int) -> bool: ...

    def resident_nbytes(self) -> int: ...


def check_write(
    spec: CausalCacheSpec,
    key: torch.Tensor,
    value: torch.Tensor,
    cache_head_start: int | None,
    debug_name: str,
) -> tuple[int, int]:
    """Validate a write's tensors against ``spec``; return the head slice ``(h0, h1)``.

    Raises CacheWriteError naming the offending value.
    """
    for label, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CacheWriteError(
                f"{debug_name}: {label} must be a torch.Tensor [B, n, h, D], got {got}"
            )
    b, n, h, d = key.shape
    h0 = 0 if cache_head_start is None else cache_head_start
    dev = spec.torch_device
    problems = [
        (key.shape != value.shape,
         f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}"),
        (b != spec.batch_size, f"batch {b} does not match spec batch_size={spec.batch_size}"),
        (d != spec.head_dim, f"head_dim {d} does not match spec head_dim={spec.head_dim}"),
        (n <= 0, f"a write needs at least one token, got n={n}"),
    ]
    for label, t in (("key", key), ("value", value)):
        problems += [
            (t.dtype != spec.dtype, f"{label} dtype {t.dtype} does not match spec dtype "
             f"{spec.dtype}; cast with .to({spec.dtype})"),
            (not on_device(t.device, dev), f"{label} is on {t.device}, the cache lives on {dev}"),
        ]
    problems += [
        (cache_head_start is None and h < spec.num_heads,
         f"the write has {h} heads, the cache {spec.num_heads}; pass cache_head_start=h0 to write "
         f"heads [h0, h0 + {h}) of the cache (a head slice), or write all {spec.num_heads} heads"),
        (not is_int(h0, 0) or h0 + h > spec.num_heads,
         f"head slice [{h0}, {h0 + h if isinstance(h0, int) else '?'}) is outside the cache's "
         f"heads [0, {spec.num_heads})"),
    ]
    for bad, problem in problems:
        if bad:
            raise CacheWriteError(f"{debug_name}: {problem}")
    return h0, h0 + h


def read_heads(spec: CausalCacheSpec, cache_head_start: int | None, num_heads: int | None) -> tuple[int, int]:
    """The head slice ``(h0, h1)`` of a read (`get_attention_kv`); CacheWriteError if not ints
    (a bool is not a head index) or outside."""
    h0 = 0 if cache_head_start is None else cache_head_start
    if not is_int(h0, None) or not (num_heads is None or is_int(num_heads, None)):
        raise CacheWriteError(
            "get_attention_kv: cache_head_start and num_heads must be ints or None, got "
            f"{cache_head_start!r} and {num_heads!r}"
        )
    h1 = spec.num_heads if num_heads is None else h0 + num_heads
    if not 0 <= h0 < h1 <= spec.num_heads:  # slicing would silently clip
        raise CacheWriteError(
            f"get_attention_kv: head slice [{h0}, {h1}) is outside the cache's heads "
            f"[0, {spec.num_heads})"
        )
    return h0, h1


def check_recent_window(recent_window_tokens: int | None) -> None:
    if recent_window_tokens is not None and not is_int(recent_window_tokens, 0):
        raise CacheWriteError(
            f"recent_window_tokens must be an int >= 0 or None, got {recent_window_tokens!r}"
        )


def on_device(actual: torch.device, wanted: torch.device) -> bool:
    """Whether a tensor on ``actual`` is on ``wanted`` (a device without an index: any of its type)."""
    return actual == wanted or (actual.type == wanted.type and wanted.index is None)


def concat_segments(segments: Sequence[KVSegment]) -> KVSegment:
    if len(segments) == 1:
        return segments[0]
    return torch.cat([s[0] for s in segments], dim=1), torch.cat([s[1] for s in segments], dim=1)
