"""`QVGPackedCausalKVCache`: the causal cache contract over a QVG segment store.

Which positions are retained and visible is decided by the same `StreamState` as the dense
cache, so views agree on positions by construction; the values live in a `SegmentStore`
(`causalkv.caches.qvg.store`): chunk segments by global position, each `DenseKV`
(``[B, len, H, D]`` in the spec dtype) or `PackedKV` (one codec `PackedSegment` for K and one
for V, ``[B, H, len, D]``). With quantization off every segment stays dense and views are
bit-for-bit those of `DenseCausalKVCache`.

Packing, applied once per advance (a segment is quantized at most once), follows the cache's
packing policy object (`causalkv.caches.qvg.policy`; `RECENT_CHUNKS` by default):

- the current chunk and the newest ``keep_recent_chunks`` completed chunks stay dense;
- sink chunks (those holding stream-start sink or pinned shot-sink tokens) are packed too
  with ``sink=True`` (the reference default), one segment per chunk (``sink_span="chunk"``)
  or the whole sink as one span once all of it is cold (``"full"``); the leading
  ``sink_keep_chunks`` sink chunks stay dense forever; ``sink=False`` keeps sink chunks dense;
- every other completed chunk is packed, ``span_chunks`` consecutive chunks at a time
  (one codebook per span; 1 = the reference behaviour);
- never worse than bf16: a span is packed only if its packed bytes (`packed_nbytes_formula`,
  decided before any quantize) are smaller than its dense bytes; otherwise it stays dense;
- PRQ's k-means centroids adapt to the span's tokens (PRQ's centroid rule,
  `causalkv.caches.codecs.prq.centroids.centroids_for`): ``min(quant.centroids, largest power
  of two <= tokens / 32)`` (at least 1), so the bf16 centroids cost at most half a bit per
  element, as the reference's 128 do on its 4,680-token chunks (docs/packed_cache.md has the
  measurements behind the rule);
- a segment whose positions all rolled out is freed; a dense segment that lost some is
  trimmed; a packed one is kept whole until all of it rolled out.

An advance is planned as values and committed at the end, so a failure (e.g. non-finite K/V
in a cold chunk) leaves the cache as it was. `packing_report()` tells what was decided for
every chunk written so far, and why.

Views are the store's lazy views (`SegmentStore.view`, the one view builder every host's cache
uses): ``view.k``/``view.v`` fill one window buffer on first access (packed ranges decoded
straight into it), while `causalkv.caches.attend` walks ``view.iter_segments()`` and so holds
one decoded segment at a time, or, on its fused path, ``view.iter_stored_segments()``
(packed head/token slices that are never decoded).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from causalkv.caches.base import StreamCache
from causalkv.caches.codecs.prq.centroids import MIN_TOKENS_PER_CENTROID
from causalkv.caches.passes import CommitPass, PassMarker
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.policy import PackingPolicy, resolve_policy
from causalkv.caches.qvg.segments import KVWrite, PackingReport, Segment
from causalkv.caches.qvg.store import SegmentStore
from causalkv.caches.qvg.tiering import codec_for
from causalkv.caches.spec import CausalAttentionKVView, CausalCacheSpec
from causalkv.caches.stream import StreamState
from causalkv.capabilities import (
    GROWTH,
    HEAD_SLICE,
    INT_INDICES,
    PINNED_SINK,
    PROBE_COMMIT,
    QUANT_QVG,
    RECENT_WINDOW,
    CacheCapabilities,
)
from causalkv.errors import ConfigError

__all__ = ["QVGPackedCausalKVCache"]


class QVGPackedCausalKVCache(StreamCache):
    """Causal KV cache whose cold chunks are packed with QVG/PRQ (see module docstring).

    Args:
        spec: the layer's cache spec (same as the dense cache).
        quant: QVG settings; ``None`` or ``bits=None`` keeps every segment dense.
        offload: keep packed segments in CPU memory (pinned when the cache is on a GPU)
            and move them back transparently when a view reads them.
        seed: k-means seed (the reference runtime's 1234); each packed segment is seeded
            with ``seed`` so packing is reproducible and the global RNG is untouched.
        head_offset: global index of the first head (default ``spec.head_offset``): each
            head's k-means draws are keyed by it, so a rank holding heads ``[a, b)`` packs
            them exactly as one process packs the same heads of the whole tensor.
        min_tokens_per_centroid: PRQ's centroid rule's ``m``
            (`causalkv.caches.codecs.prq.centroids.centroids_for`, default 32); 1 allows up to
            one centroid per token (never more than ``quant.centroids``); None packs with
            ``quant.centroids`` as given.
        policy: which completed chunks stay dense, a `PackingPolicy` object:
            `causalkv.caches.qvg.policy.RECENT_CHUNKS` (the rule above, the default) or
            ``RECENT_NON_SINK`` (the newest ``keep_recent_chunks`` non-sink chunks; sink chunks
            are packed as soon as they are completed unless ``sink=False`` or among the leading
            ``sink_keep_chunks``). The names ``"recent-chunks"``/``"recent-non-sink"`` are
            accepted too.
        marker: the caller's `causalkv.caches.passes.PassMarker` (`use_marker`): its
            probes store nothing, its commit moves the chunk to its tier at once and drops
            what the next advance drops; the cache reports its bytes to its ledger.

    Attributes:
        store: the `SegmentStore` holding the K/V.
        segments: the storage, ascending global position; the last one is the current chunk.
        quantize_calls: how many times the codec packed a K/V pair (tests assert that no
            segment is packed twice).
        peak_transient_nbytes: the largest dense K+V buffer filled from packed data in one
            go (one segment when streaming, the window when materialized).
    """

    capabilities = CacheCapabilities.of(
        PINNED_SINK, HEAD_SLICE, RECENT_WINDOW, GROWTH, INT_INDICES, QUANT_QVG, PROBE_COMMIT
    )

    # ---- before any weights load (the host calls these on the chosen cache's class) -----------
    @classmethod
    def check_request(cls, options: QVGKVQuantArgs | None, *, head_dim: int, device: str) -> None:
        """Refuse settings that cannot run (`ConfigError`): a block layout that does not fit
        ``head_dim`` (`QVGKVQuantArgs.check_layout`), a codec (or recency tier) that does not
        run on ``device`` (the codec's own check, `KVCodec.device_problem`: PRQ's backend,
        ``CAUSALKV_QVG_BACKEND``)."""
        if options is None or not options.enabled:
            return
        options.check_layout(head_dim)
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError, TypeError):
            return  # the host names a bad device
        for name in (c for c in (options.codec, options.recent_tier) if c != "bf16"):
            problem = codec_for(replace(options, codec=name)).device_problem(dev)
            if problem is not None:
                raise ConfigError(problem)

    @classmethod
    def describe_request(
        cls, options: QVGKVQuantArgs | None, *, tokens_per_chunk: int, sink_tokens: int
    ) -> list[str]:
        """The run header's lines for these settings: the codec's own (`KVCodec.request_lines`:
        PRQ's centroids per packed span; none for fp8, nvfp4 or a plugin codec), given the
        tokens of a packed span and of a sink packed whole."""
        if options is None or not options.enabled:
            return []
        whole_sink = sink_tokens if options.sink and options.sink_span == "full" else 0
        return codec_for(options).request_lines(tokens_per_chunk * options.span_chunks, whole_sink)

    def __init__(
        self,
        spec: CausalCacheSpec,
        quant: QVGKVQuantArgs | None = None,
        *,
        offload: bool = False,
        seed: int = 1234,
        min_tokens_per_centroid: int | None = MIN_TOKENS_PER_CENTROID,
        head_offset: int | None = None,
        policy: PackingPolicy | str = "recent-chunks",
        marker: PassMarker | None = None,
    ) -> None:
        self.policy = resolve_policy(policy)
        self.quant = quant or QVGKVQuantArgs()
        self.spec = spec
        #: global index of the first head: the codec keys each head's k-means draws by it
        self.head_offset = spec.head_offset if head_offset is None else head_offset
        self.store = SegmentStore(
            batch_size=spec.batch_size, num_heads=spec.num_heads, head_dim=spec.head_dim,
            dtype=spec.dtype, device=spec.torch_device, quant=self.quant, policy=self.policy,
            seed=seed, head_offset=self.head_offset, offload=offload,
            min_tokens_per_centroid=min_tokens_per_centroid,
        )
        self.state = StreamState.from_spec(spec)
        self.use_marker(marker)

    def use_marker(self, marker: PassMarker | None) -> None:
        """`StreamCache.use_marker`; the store reports to the marker's ledger."""
        super().use_marker(marker)
        self.store.ledger = None if marker is None else marker.ledger
        if marker is not None:
            marker.ledger.hold(self.store, self.store.resident_nbytes())

    def _write(
        self, key: torch.Tensor, value: torch.Tensor, new: StreamState, heads: tuple[int, int],
        recent_window_tokens: int | None, commit: CommitPass | None,
    ) -> CausalAttentionKVView:
        """`StreamCache._write`, planned whole. A commit moves the chunk to its tier in the
        same step (packed straight from the write's K/V when the policy does not keep it).
        The write and the move are planned first and committed as one: a refused call
        changes nothing."""
        n, st = key.shape[1], self.state
        advance = new is not st
        write = KVWrite(new.cur_start, new.cur_start + n, heads, key, value)
        # an advance evicts, packs cold chunks and adds the new chunk; a rewrite is in place
        # while dense segments hold the chunk, else (a chunk a commit already moved to its
        # tier) decoded back to dense
        keep = new.holding() if advance else replace(st.holding(), held=self.store.held())
        plan = self.store.plan(write, keep, advance=advance)
        passed, done = self._commit_pass(new.cur_start, heads, commit)
        if not done:
            self.store.commit(plan)  # nothing below can fail
            self.state, self._pass = new, passed
            return self._view(*heads, recent_window_tokens)
        plan = self.store.plan_commit(plan, new.after_context(commit.pin, commit.next_tokens))
        # the view reads the layout before the commit drops what the next advance drops
        view = self._view(*heads, recent_window_tokens, plan.view_segments, new)
        self.store.commit(plan)  # nothing below can fail
        self.state, self._pass = new.committed(commit.pin, commit.next_tokens), passed
        return view

    # ---- the store's figures -----------------------------------------------------------
    @property
    def segments(self) -> list[Segment]:
        return self.store.segments

    @property
    def quantize_calls(self) -> int:
        return self.store.quantize_calls

    @property
    def peak_transient_nbytes(self) -> int:
        return self.store.peak_transient_nbytes

    @peak_transient_nbytes.setter
    def peak_transient_nbytes(self, value: int) -> None:
        self.store.peak_transient_nbytes = value

    def resident_nbytes(self) -> int:
        """Exact bytes held now (`SegmentStore.resident_nbytes`: shared codebooks once)."""
        return self.store.resident_nbytes()

    def packed_segments(self) -> list[Segment]:
        return self.store.packed_segments()

    def packing_report(self) -> PackingReport:
        """Chunks packed and kept dense (and why) so far, and the centroids used."""
        return self.store.packing_report()

    # ---- views ------------------------------------------------------------------------
    def probe_view(self, key, value, new, heads, recent_window_tokens):
        """`StreamCache.probe_view` as a lazy view: the store's segments for the history (packed
        ones decoded only when read, one at a time when streamed) and the caller's own K/V
        for the chunk's rows (`SegmentStore.with_own`); nothing stored, nothing changed."""
        own = self.store.with_own(new.cur_start, key, value, heads[0])
        return self._view(*heads, recent_window_tokens, own, new)

    def _view(
        self, h0: int, h1: int, recent_window_tokens: int | None,
        layout: list[Segment] | None = None, state: StreamState | None = None,
    ) -> CausalAttentionKVView:
        """The store's view (`SegmentStore.view`) of the visible positions of ``state``
        (default: now), read from ``layout`` (default: the store's segments); ``k``/``v``
        built at once when nothing visible is packed, as the dense cache's are."""
        st = self.state if state is None else state
        pieces = [(a, b - a) for a, b in st.visible(recent_window_tokens)]
        return self.store.view(pieces, h0, h1, layout, dense_now=True,
                               make=functools.partial(self._make_view, state=st))

    # ---- control ----------------------------------------------------------------------
    def reset_indices(self) -> None:
        """Forget the stream (new request) and free every segment.

        `packing_report` keeps counting: the dropped chunks count with their last storage.
        """
        self.state = StreamState.from_spec(self.spec)
        self._pass = (-1, frozenset())
        self.store.reset()
