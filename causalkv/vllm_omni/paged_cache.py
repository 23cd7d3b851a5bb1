"""causalkv's pages on vLLM-Omni's paged AR-diffusion engine (realtime sessions): packed groups
beside the engine's bf16 pool, admission in compressed bytes.

vLLM-Omni's ``ARDiffusionModelRunner`` keeps each realtime session's self-attention K/V in an
``ARDiffusionKVCache``: one pool page per latent frame (all heads of one layer, per layer),
vLLM's ``KVCacheManager`` / ``BlockPool`` handing out pages, a compact block table per session
(its pages in logical order), and ``sink + window`` frames held between ticks. causalkv's
`CausalKVPagedKVCache` is that class with three changes, for a pipeline whose spec asks for it
(its KV branch is a `CausalKVBranchSpec` carrying the QVG settings):

- **Admission** counts a session as it is held: the groups (ticks of ``frames_per_block``
  frames) the next forward reads and no other, bf16 groups as pool pages and packed groups at
  their codec's bytes (`causalkv.vllm_omni.admission.admit` on
  `~causalkv.vllm_omni.admission.causalkv_layout`: the formula ``causalkv memory lingbot
  --host vllm-omni`` prints). The engine's own constructor runs first (its validation, spec,
  scratch, cross-attention and staging arithmetic, built without tensors); the figures it
  reports are checked against the formula's, then the pool and manager are built at causalkv's
  block count.
- **Commits.** When a tick's last frame is committed (``commit_chunk``), the session's stream
  cursor (`causalkv.caches.stream.StreamState`, as the planner runs it) says which positions
  the next forward reads; the groups outside them are dropped (the oldest window group the
  stock pool keeps unread among them); the packing policy and the store's tier policy decide,
  as for `causalkv.caches.qvg.store.SegmentStore`, which held groups are packed, and
  `causalkv.caches.qvg.store_pack.Packer` packs them from their pool rows, layer by layer, into
  records keyed by the session's logical positions. Every page no group keeps in bf16 goes back
  to the pool through vLLM's own release, and the session's block table is compacted, so the
  table is the logical-to-physical map of its bf16 frames.
- **Attention.** LingBot's self-attention calls the module global ``paged_write_attn``;
  `paged_write_attn` (installed by `install_engine_seams`) serves this cache's pools and
  passes any other call to vLLM-Omni's. It writes the forward's K/V into the pool slots as the
  engine does, then reads the visible frames in the engine's order (sink first, the newest
  last): with no packed group visible, straight from the pool pages through vLLM-Omni's
  ``ar_diffusion_paged_attention`` (its einsum reference off CUDA, its paged FlashAttention on
  CUDA). With packed groups visible, the visible frames are one lazy view (`_segment_view`):
  on CUDA `causalkv.caches.attend` runs over it segment by segment (its fused path: packed
  groups read in place by their codec's kernel, runs of pool pages attended as dense segments,
  merged by log-sum-exp), so the window is never materialized; elsewhere (the reference path)
  one layer's visible K/V are gathered into one transient buffer (pages copied, packed groups
  decoded in place) and the same kernel runs over it. `causalkv.caches.attention.forced_route`
  picks either on any device (the tests and the benchmark).

Closing, evicting or failing a session ends its adapters (``end_request``): its pages and its
packed records go. The seams used here are listed in `causalkv.vllm_omni.paged_seams`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm_omni.diffusion.models.lingbot_world import transformer as _lingbot_transformer
from vllm_omni.experimental.ar_diffusion import runner as _runner
from vllm_omni.experimental.ar_diffusion.capability import ARDiffusionKVBranchSpec
from vllm_omni.experimental.ar_diffusion.kv_cache.manager import (
    ARDiffusionKVCache,
    build_kv_manager,
)
from vllm_omni.experimental.ar_diffusion.kv_cache.paged import allocate_kv_pool_with_views
from vllm_omni.experimental.ar_diffusion.kv_cache.paged_attention import (
    ar_diffusion_paged_attention,
)

from causalkv.caches.attention import AttendStats, attend, route_override
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.segments import Codebook, DenseKV, Segment, held_nbytes
from causalkv.caches.qvg.store_pack import Packer
from causalkv.caches.qvg.tiering import BookState, Packed, TierSegment, keep_held, tier_policy
from causalkv.caches.spec import CausalAttentionKVView
from causalkv.caches.stream import StreamState
from causalkv.config import DTYPES
from causalkv.errors import ConfigError
from causalkv.vllm_omni.admission import (
    ENGINE_CACHE,
    Admission,
    EngineGeometry,
    SessionLayout,
    admit,
    causalkv_layout,
    required_bytes,
    stock_layout,
)

__all__ = [
    "CausalKVBranchSpec",
    "CausalKVPagedKVCache",
    "PagedGroup",
    "SessionReport",
    "check_kv_config",
    "declared_capacity",
    "engine_geometry",
    "install_engine_seams",
    "live_caches",
    "paged_write_attn",
    "session_cache",
]

logger = logging.getLogger(__name__)
#: the k-means seed of causalkv's stores (`SegmentStore`'s default): packing is reproducible
SEED = 1234
#: the pool dtypes causalkv counts: `causalkv.config.DTYPES`, by torch dtype
_DTYPES = {getattr(torch, name): name for name in DTYPES}


@dataclass(frozen=True)
class CausalKVBranchSpec(ARDiffusionKVBranchSpec):
    """An ``ARDiffusionKVBranchSpec`` whose pages causalkv holds: the QVG settings (``quant``;
    ``kv_cache_quant: off`` keeps every group bf16) and the global index of this rank's first
    head (``head_offset``: the codec seeds each head by it, as the request-mode store does)."""

    quant: QVGKVQuantArgs = field(default_factory=QVGKVQuantArgs)
    head_offset: int = 0


@dataclass(frozen=True, eq=False)
class PagedGroup(TierSegment):
    """A run ``[start, end)`` of one session's held positions (tokens): bf16 pool pages
    (``layers`` None) or packed, one store `Segment` per layer. What the tier policy reads of a
    segment (`causalkv.caches.qvg.tiering.TierSegment`)."""

    start: int
    end: int
    first_chunk: int
    last_chunk: int
    layers: tuple[Segment, ...] | None = None
    recent: bool = False
    rewritten: bool = False

    @property
    def packed(self) -> bool:
        return self.layers is not None



@dataclass
class _Session:
    """causalkv's record of one session branch (one engine adapter).

    Attributes:
        frames: the logical frame of each page of the adapter's compact block table, in order.
        groups: the held positions, ascending (`PagedGroup`: pool pages or packed records; a
            packed span is kept whole while any of it is held).
        held: the positions the next forward reads besides its own (the cursor's, after the
            last tick): what a view shows of ``groups``.
        cursor: the stream cursor (`StreamState`), advanced one tick at a time.
        books: per layer, the codebook the next packed span may join.
        book: the tier policy's view of it.
        packed_reads: layer calls that decoded a packed group.
        packs: groups packed so far.
    """

    frames: list[int]
    groups: list[PagedGroup]
    cursor: StreamState
    books: list[Codebook | None]
    held: tuple[tuple[int, int], ...] = ()
    book: BookState | None = None
    packed_reads: int = 0
    packs: int = 0


@dataclass(frozen=True)
class SessionReport:
    """What one session branch holds now (`CausalKVPagedKVCache.report`).

    Attributes:
        pages: pool pages (latent frames) it holds.
        pool_bytes: those pages in every layer (``pages x page bytes``).
        packed_bytes: its packed records in every layer (a shared codebook counted once).
        packed_groups: its packed groups, by logical frame ``[first, last)``.
        packed_reads: layer calls that decoded one of its packed groups.
        packs: groups packed so far.
    """

    pages: int
    pool_bytes: int
    packed_bytes: int
    packed_groups: tuple[tuple[int, int], ...]
    packed_reads: int
    packs: int

    @property
    def nbytes(self) -> int:
        return self.pool_bytes + self.packed_bytes


#: the engine options causalkv's pages do not serve, and why
_UNSERVED = {
    "reset_at_boundary": "causalkv's pages keep the sink and the newest ticks (LingBot-World's "
                         "sliding window)",
    "reuse_history_staging": "causalkv's attention reads packed groups that a staged window "
                             "would not hold",
}


def check_kv_config(config: Any) -> None:
    """`ConfigError` for an ``ARDiffusionKVConfig`` option causalkv's pages do not serve
    (`_UNSERVED`: ``reset_at_boundary``, ``reuse_history_staging``)."""
    for option, why in _UNSERVED.items():
        if getattr(config, option, False):
            raise ConfigError(f"ar_diffusion_kv_config.{option} is not supported with "
                              f"model_config.causalkv_kv_cache: {why}; drop {option}")


def engine_geometry(config: Any, *, num_layers: int, num_kv_heads: int, head_size: int,
                    dtype: torch.dtype, block_size: int, kv_branches: Sequence[Any],
                    cross_attention_lengths: dict[str, int] | None = None,
                    cross_attention_kv_heads: dict[str, int] | None = None, frames_per_block: int = 1,
                    max_scratch_tokens_per_branch: int = 0,
                    model_owned_state_bytes_per_session: int = 0) -> EngineGeometry:
    """The `EngineGeometry` of ``ARDiffusionKVCache``'s constructor arguments (the runner's
    ``ARDiffusionKVConfig`` and the pipeline's spec). `ConfigError` for a pool dtype causalkv
    does not count (not bf16, fp16 or fp32) or history staging (``reuse_history_staging``, not
    modelled)."""
    if dtype not in _DTYPES:
        raise ConfigError(f"causalkv's paged cache holds bfloat16, float16 or float32 pages, got {dtype}")
    check_kv_config(config)
    heads = dict(cross_attention_kv_heads or {})
    cross = tuple((int(n), int(heads.get(name, num_kv_heads)))
                  for name, n in (cross_attention_lengths or {}).items())
    local = max(b.local_index for b in kv_branches) + 1
    return EngineGeometry(
        "AR-diffusion engine", num_layers, num_kv_heads, head_size, _DTYPES[dtype], block_size,
        frames_per_block, int(config.sink_chunks), int(config.window_chunks),
        kv_branches=len(kv_branches), local_kv_branches=local, cross_attention=cross,
        model_state_bytes=int(model_owned_state_bytes_per_session),
        scratch_blocks_per_branch=max(  # the engine's scratch rule (ARDiffusionKVCache.__init__)
            frames_per_block + (max_scratch_tokens_per_branch + block_size - 1) // block_size,
            int(os.environ.get("AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH", "0") or 0)),
    )


def declared_capacity(spec: Any, kv_config: Any, dtype: torch.dtype, available_bytes: int,
                      quant: QVGKVQuantArgs) -> int:
    """The sessions causalkv's pages hold for the pipeline's ``spec`` at ``available_bytes`` of
    free memory: the runner's config resolution (``ARDiffusionModelRunner._preallocate_kv_cache``:
    the spec fills what the stage config leaves unset), then `admit` with no cap. What causalkv's
    pipeline declares as ``session_capacity`` instead of LingBot's 2."""
    config = dataclasses.replace(
        kv_config, chunk_size=spec.tokens_per_frame,
        window_chunks=kv_config.window_chunks or spec.window_frames,
        sink_chunks=kv_config.sink_chunks or spec.sink_frames,
        reset_at_boundary=kv_config.reset_at_boundary or spec.reset_at_boundary)
    # the spec's fields the runner passes as they are
    same = ("num_layers", "num_kv_heads", "head_size", "kv_branches", "cross_attention_lengths",
            "cross_attention_kv_heads", "frames_per_block", "max_scratch_tokens_per_branch",
            "model_owned_state_bytes_per_session")
    eng = engine_geometry(config, dtype=dtype, block_size=spec.tokens_per_frame,
                          **{name: getattr(spec, name) for name in same})
    return admit(eng, causalkv_layout(eng, quant), available_bytes=available_bytes,
                 gpu_memory_fraction=config.gpu_memory_fraction).capacity


#: the session caches built in this process, oldest first: causalkv's, and vLLM-Omni's own
#: that `session_cache` built (for a measurement of the stock pool)
#: (by id; an entry goes when its cache is collected)
_LIVE: weakref.WeakValueDictionary[int, ARDiffusionKVCache] = weakref.WeakValueDictionary()


def _track(cache: ARDiffusionKVCache) -> ARDiffusionKVCache:
    _LIVE[id(cache)] = cache
    return cache


def live_caches(*, stock: bool = False) -> list[Any]:
    """The `CausalKVPagedKVCache` objects alive in this process (the worker's, when it runs in
    process), oldest first; ``stock``: vLLM-Omni's own caches `session_cache` built instead."""
    return [c for c in list(_LIVE.values()) if isinstance(c, CausalKVPagedKVCache) is not stock]


class CausalKVPagedKVCache(ARDiffusionKVCache):
    """vLLM-Omni's ``ARDiffusionKVCache`` holding causalkv's pages (the module docstring).

    Args:
        config, max_model_len, ...: ``ARDiffusionKVCache``'s arguments, as the runner passes
            them (``num_layers``, ``dtype`` and the rest of the geometry as keywords).
        quant: the QVG settings (``bits=None``: every group bf16).
        head_offset: global index of this rank's first head (the codec's seeds).

    Attributes:
        quant: the settings.
        geometry: the `EngineGeometry` admitted on.
        layout: what one session holds at most (`SessionLayout`: bf16 frames, packed bytes).
        admission: the `Admission` (capacity, pool blocks, budget).

    Raises:
        ConfigError: more than one KV branch (LingBot-World has one), a sink or window that is
            not a whole number of ticks, settings the codec cannot pack at ``head_size``, a
            pool dtype or option causalkv does not model, or one session not fitting the free
            memory; the engine's own errors for the rest. At run time: a prefill prefix, and a
            forward (probe or committing) that is not a whole number of ticks.
    """

    def __init__(self, config: Any, *, quant: QVGKVQuantArgs, head_offset: int = 0,
                 max_model_len: int, available_bytes: int, session_capacity: int,
                 device: torch.device | None = None, **shape: Any) -> None:
        # ``shape``: the engine's other arguments (what the geometry is read from)
        if len(shape["kv_branches"]) != 1:
            raise ConfigError(
                f"causalkv's paged cache holds one KV branch (LingBot-World's), the spec declares "
                f"{[b.name for b in shape['kv_branches']]}")
        eng = engine_geometry(config, **shape)
        adm = admit(eng, causalkv_layout(eng, quant), available_bytes=available_bytes,
                    gpu_memory_fraction=config.gpu_memory_fraction,
                    requested_capacity=session_capacity)
        # vLLM-Omni's constructor: its checks, the ChunkWindowSpec, the scratch, cross-attention
        # and staging arithmetic; built without tensors at one stock session (a pool of
        # sink + window + frames_per_block + 2 blocks), replaced below at causalkv's admission
        super().__init__(
            dataclasses.replace(config, gpu_memory_fraction=1.0), max_model_len=max_model_len,
            available_bytes=required_bytes(eng, stock_layout(eng), 1), session_capacity=1,
            device=None, **shape)
        figures = {
            "page bytes": (eng.page_bytes, self.spec.page_size_bytes * self.num_layers),
            "scratch bytes": (eng.scratch_bytes, self.scratch_reserved_bytes),
            "cross-attention bytes per session": (eng.cross_bytes,
                                                  self.cross_attention_bytes_per_session)}
        drift = {k: pair for k, pair in figures.items() if pair[0] != pair[1]}
        if drift:
            raise ConfigError(
                f"vLLM-Omni's ARDiffusionKVCache counts {drift} (causalkv, engine) differently from "
                "the admission formula read from vLLM-Omni 0.30.0 (causalkv.vllm_omni.paged_seams); "
                "install vllm-omni==0.30.0")
        self.config = config
        self.quant = quant.validate()
        self.head_offset = int(head_offset)
        self.geometry = eng
        self.layout: SessionLayout = adm.layout
        self.admission: Admission = adm
        self.requested_session_capacity = session_capacity
        self.available_memory_bytes = available_bytes
        self.configured_memory_budget_bytes = adm.configured_budget_bytes
        self.memory_budget_bytes = adm.memory_budget_bytes
        self.session_capacity = adm.capacity
        self.cross_attention_reserved_bytes = eng.cross_bytes * adm.capacity
        self.model_owned_state_reserved_bytes = eng.model_state_bytes * adm.capacity
        layer_names = [f"ar_diffusion.layer.{i}" for i in range(self.num_layers)]
        self.manager = build_kv_manager(self.spec, layer_names, adm.pool_blocks, max_model_len)
        self.managed_num_blocks = self.num_blocks = adm.pool_blocks
        self.num_blocks_total = self.managed_num_blocks + self.scratch_num_blocks
        self.null_block_id = self.manager.block_pool.null_block.block_id
        self.device = device or torch.device("cpu")
        self._allocate_tensors = device is not None
        if device is not None:
            self._kv_pools, self._k_pools, self._v_pools = allocate_kv_pool_with_views(
                self.num_blocks_total, self.block_size, self.num_layers, self.num_kv_heads,
                self.head_size, self.dtype, device)
        self.tiering = tier_policy(self.quant, ENGINE_CACHE.min_tokens_per_centroid, 1, self.num_kv_heads,
                                   self.head_size, self.geometry.itemsize)
        self.packer = Packer(self.device, self.dtype, SEED, self.head_offset, False)
        self._records: dict[str, _Session] = {}
        self._bound: Any = None
        self._view: tuple[torch.Tensor, Any] | None = None
        _track(self)

    # -- sessions ------------------------------------------------------------------------------
    def begin_request(self, request_id: str, *, prefill_prefix_tokens: int = 0) -> Any:
        if prefill_prefix_tokens:
            raise ConfigError("causalkv's paged cache takes no prefill prefix (LingBot-World has none)")
        adapter = super().begin_request(request_id, prefill_prefix_tokens=prefill_prefix_tokens)
        tpf, eng = self.block_size, self.geometry
        self._records[request_id] = _Session(
            frames=[], groups=[],
            cursor=StreamState.opened(sink_tokens=eng.sink_frames * tpf,
                                      global_sink_tokens=eng.sink_frames * tpf,
                                      cache_tokens=(eng.sink_frames + eng.window_frames) * tpf),
            books=[None] * self.num_layers)
        return adapter

    def end_request(self, adapter: Any) -> None:
        """vLLM-Omni's release (every page back to the pool) and the session's packed records
        dropped: a session closed, evicted or failed holds nothing afterwards."""
        try:
            super().end_request(adapter)
        finally:
            self._records.pop(adapter.request_id, None)
            self._view = None

    def sessions(self) -> tuple[str, ...]:
        """The adapters (session branches) with causalkv records."""
        return tuple(self._records)

    def _record(self, adapter: Any) -> _Session:
        try:
            return self._records[adapter.request_id]
        except KeyError:
            raise RuntimeError(
                f"causalkv's paged cache has no record of {adapter.request_id!r}: the session was "
                "closed, evicted or failed") from None

    def allocate_token_slots(self, adapter: Any, num_tokens: int) -> list[int]:
        """vLLM-Omni's allocation for the committing forward; the new pages' logical frames are
        noted (the session's logical-to-physical map: page ``i`` of the compact table at or past
        the storage position holds logical frame ``i`` plus the frames compacted away, the
        adapter's absolute position less its storage position)."""
        rec = self._record(adapter)
        self._check_whole_ticks(num_tokens)
        table = super().allocate_token_slots(adapter, num_tokens)
        compacted = adapter.compacted_tokens // self.block_size
        rec.frames.extend(i + compacted for i in range(len(rec.frames), len(table)))
        return table

    def _check_whole_ticks(self, tokens: int) -> None:
        """`ConfigError` for a forward of ``tokens`` that is not a whole number of ticks: a
        session is settled at each tick's end for a next forward of whole ticks, so a forward
        ending inside a tick would read frames already dropped. LingBot-World's transformer
        takes exactly one tick per forward; vLLM-Omni's state and cache take any frames."""
        if tokens % (self.frames_per_block * self.block_size):
            raise ConfigError(
                f"causalkv's paged cache runs forwards of whole ticks ({self.frames_per_block} "
                f"frames of {self.block_size} tokens, as LingBot-World's), got {tokens} tokens; "
                "forward a multiple of frames_per_block frames")

    def commit_chunk(self, adapter: Any) -> None:
        """A frame committed (the engine's per-frame call). At a tick's end causalkv settles
        the session: what the next forward does not read is dropped, cold groups are packed,
        their pages go back to the pool, the table is compacted. Nothing of vLLM-Omni's
        sliding-window eviction runs: the settled table never reaches it."""
        rec = self._record(adapter)
        adapter.on_chunk_committed()
        if adapter.completed_chunks % self.frames_per_block:
            return
        g = adapter.completed_chunks // self.frames_per_block - 1  # the tick just completed
        tpf = self.block_size
        n = self.frames_per_block * tpf  # tokens of one tick
        rec.cursor = rec.cursor.advanced(n, f"causalkv paged session {adapter.request_id}")
        ctx = rec.cursor.after_context(False)
        segs = keep_held([*rec.groups, PagedGroup(g * n, (g + 1) * n, g, g)], ctx.held, self._cut)
        book = rec.books[0]
        if book is not None and not any(s.packed and book.used_by(s.layers[0]) for s in segs):
            rec.book, rec.books = None, [None] * self.num_layers  # every group using it rolled out
        if self.quant.enabled:
            def pack(step: Packed[PagedGroup], book: BookState | None) -> tuple[PagedGroup, BookState | None]:
                return self._pack(adapter, rec, step), book if step.tier else step.book_after

            segs, rec.book, _ = self.tiering.settle(
                ENGINE_CACHE.policy, segs, g + 1, rec.book, pack, sink_end=ctx.sink_end,
                pinned=ctx.pinned, sink_open=ctx.sink_end > (g + 1) * n, chunk_tokens=n,
                finite=lambda pieces: self._finite(adapter, rec, pieces))
        keep = {f for s in segs if not s.packed for f in range(s.start // tpf, s.end // tpf)}
        # a committing forward of several ticks: its later ticks' pages wait for their commits
        keep.update(f for f in rec.frames if f >= adapter.completed_chunks)
        rec.groups = segs
        rec.held = tuple(ctx.held)
        self._release(adapter, rec, keep)

    def _cut(self, seg: PagedGroup, a: int, b: int) -> PagedGroup:
        if a % self.block_size or b % self.block_size:
            raise RuntimeError(f"causalkv's paged cache cuts whole frames, got [{a}, {b})")
        n = self.frames_per_block * self.block_size
        return PagedGroup(a, b, a // n, (b - 1) // n)

    def _rows(self, adapter: Any, rec: _Session, seg: PagedGroup, layer: int) -> Segment:
        """``seg``'s K/V of one layer as a dense store `Segment` ``[1, len, H, D]``: pool rows
        (a copy) or the packed record decoded (a recency-tier group re-packed)."""
        if seg.packed:
            return self.packer.dense(seg.layers[layer])
        page = dict(zip(rec.frames, self.block_table(adapter)))  # logical frame -> pool page
        bs = self.block_size
        ids = torch.tensor([page[f] for f in range(seg.start // bs, seg.end // bs)],
                           dtype=torch.long, device=self.device)
        k = self.key_cache(layer).index_select(0, ids).reshape(1, -1, self.num_kv_heads, self.head_size)
        v = self.value_cache(layer).index_select(0, ids).reshape(1, -1, self.num_kv_heads, self.head_size)
        return Segment(seg.start, seg.end, seg.first_chunk, seg.last_chunk, DenseKV(k, v))

    def _finite(self, adapter: Any, rec: _Session, pieces: Sequence[PagedGroup]) -> bool:
        """Whether the pieces' K/V are finite in every layer (`Packer.finite`, as the store
        checks; a group is packed in all layers or none: its pages serve all of them)."""
        return all(self.packer.finite([self._rows(adapter, rec, p, layer) for p in pieces])
                   for layer in range(self.num_layers))

    def _pack(self, adapter: Any, rec: _Session, step: Packed[PagedGroup]) -> PagedGroup:
        """One tier step packed in every layer (`Packer.encode` on the pieces' rows)."""
        layers = []
        for layer in range(self.num_layers):
            pieces = [self._rows(adapter, rec, p, layer) for p in step.pieces]
            seg, rec.books[layer] = self.packer.encode(step, pieces, rec.books[layer])
            layers.append(seg)
        rec.packs += 1
        first, last = step.pieces[0], step.pieces[-1]
        return PagedGroup(first.start, last.end, first.first_chunk, last.last_chunk,
                          layers=tuple(layers), recent=step.recent)

    def _release(self, adapter: Any, rec: _Session, keep: set[int]) -> None:
        """Every page whose frame is not in ``keep`` back to the pool (vLLM's release), then the
        table compacted (the adapter's storage position moved by what was removed)."""
        mgr = self.manager.coordinator.single_type_managers[0]
        rid = adapter.request_id
        for i, f in enumerate(rec.frames):
            if f not in keep:
                mgr._remove_blocks_in_range(rid, i, i + 1)
        blocks = mgr.req_to_blocks.get(rid, [])
        kept = [(b, f) for b, f in zip(blocks, rec.frames) if f in keep]
        adapter.compacted_tokens += (len(blocks) - len(kept)) * self.block_size
        blocks[:] = [b for b, _ in kept]
        rec.frames = [f for _, f in kept]

    # -- what a session holds ----------------------------------------------------------------
    def report(self, request_id: str) -> SessionReport:
        """What the session branch ``request_id`` (an adapter's id) holds now."""
        rec, bs = self._records[request_id], self.block_size
        packed = [g for g in rec.groups if g.packed]
        pages = len(rec.frames)
        return SessionReport(pages, pages * self.geometry.page_bytes,
                             held_nbytes(seg for g in packed for seg in g.layers),
                             tuple((g.start // bs, g.end // bs) for g in packed),
                             rec.packed_reads, rec.packs)

    # -- attention -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def binding(self, state: Any) -> Iterator[None]:
        """The session ``state`` (the runner's ``ARDiffusionKVState``) is the one this cache's
        attention serves until the context exits (the pipeline binds it per invocation)."""
        if self._bound is not None:
            raise RuntimeError("causalkv's paged cache is already bound to a session")
        self._bound = state
        try:
            yield
        finally:
            self._bound = None
            self._view = None

    def _forward_view(self, inputs: Any) -> list[tuple[str, Any, int, int]]:
        """The frames one forward reads, in the engine's order, as runs of tokens: ``("page",
        ids, 0, len(ids) x block_size)`` for pool pages, ``("packed", group, lo, hi)`` for
        tokens ``[lo, hi)`` of a packed group (relative to its start). Built once per forward
        (its block table)."""
        if self._view is not None and self._view[0] is inputs.block_table:
            return self._view[1]
        state = self._bound
        if state is None:
            raise RuntimeError("causalkv's paged attention ran with no session bound "
                               "(the pipeline binds one per invocation)")
        (adapter,) = state.adapters.values()
        rec = self._record(adapter)
        bs = self.block_size
        table = self.block_table(adapter)
        current = [int(s) // bs for s in inputs.video_slots[::bs].tolist()]
        commit = bool(current) and table[-len(current):] == current and all(
            b < self.managed_num_blocks for b in current)
        if not commit and not all(b >= self.managed_num_blocks for b in current):
            raise RuntimeError("causalkv's paged attention: the forward's current pages are neither "
                               "the session's newest pages nor scratch")
        where = dict(zip(rec.frames, table))
        # logical frame -> pool page id, or (packed group, offset in it)
        history: dict[int, Any] = {f: where[f] for f in (rec.frames[:-len(current)] if commit else rec.frames)}
        for g in rec.groups:
            for f in range(g.start // bs, g.end // bs):
                if any(a <= f * bs < b for a, b in rec.held):  # a packed span's rolled-out part: not shown
                    history[f] = (g, f * bs - g.start) if g.packed else where[f]
        # the current frames last: the pages the slots name
        entries: list[Any] = [history[f] for f in sorted(history)] + current
        sink, window = self.spec.sink_chunks, self.spec.sliding_window // bs
        if len(entries) > sink + window:  # the engine's rule: the sink, then the newest
            entries = entries[:sink] + entries[-window:]
        runs: list[tuple[str, Any, int, int]] = []
        for e in entries:
            if isinstance(e, tuple):
                g, off = e
                if runs and runs[-1][0] == "packed" and runs[-1][1] is g and runs[-1][3] == off:
                    runs[-1] = ("packed", g, runs[-1][2], off + bs)
                else:
                    runs.append(("packed", g, off, off + bs))
            elif runs and runs[-1][0] == "page":
                runs[-1][1].append(int(e))  # the same list, its span one page longer
                runs[-1] = (*runs[-1][:3], runs[-1][3] + bs)
            else:
                runs.append(("page", [int(e)], 0, bs))
        self._view = (inputs.block_table, runs)
        return runs

    def attend(self, layer: int, inputs: Any, query: torch.Tensor, k_curr: torch.Tensor,
               v_curr: torch.Tensor, k_act: torch.Tensor | None, v_act: torch.Tensor | None,
               softmax_scale: float) -> torch.Tensor:
        """One layer's paged self-attention over this cache (``paged_write_attn``'s contract):
        the forward's K/V written to its slots, then attention over the visible frames (the
        module docstring: the pool pages, `causalkv.caches.attend` over `_segment_view`, or
        the transient buffer)."""
        if k_act is not None and k_act.shape[0] > 0:
            raise ConfigError("causalkv's paged cache does not hold action tokens (LingBot-World has none)")
        self._check_whole_ticks(int(inputs.video_slots.numel()))  # a probe (a commit: at allocation)
        key_pool, value_pool = inputs.key_pool, inputs.value_pool
        key_pool[inputs.video_slots] = k_curr.to(key_pool.dtype)
        value_pool[inputs.video_slots] = v_curr.to(value_pool.dtype)
        bs = int(inputs.block_size)
        key_cache = key_pool.unflatten(0, (-1, bs))
        value_cache = value_pool.unflatten(0, (-1, bs))
        runs = self._forward_view(inputs)
        frames = sum(hi - lo for _, _, lo, hi in runs) // bs
        width = max(int(inputs.block_table.shape[1]), frames)
        if all(r[0] == "page" for r in runs):  # the pool pages as they are
            ids = [i for r in runs for i in r[1]]
            kc, vc = key_cache, value_cache
        else:
            (adapter,) = self._bound.adapters.values()
            self._record(adapter).packed_reads += 1
            view = self._segment_view(layer, runs, key_cache, value_cache)
            forced = route_override()
            if (query.is_cuda if forced is None else forced.routed) and query.shape[1] == self.num_kv_heads:
                # causalkv's packed attention (on CUDA its fused path), never the whole window
                stats = AttendStats()
                out = attend(query.unsqueeze(0), view, scale=softmax_scale, stats=stats,
                             fused=None if forced is None else forced.fused)
                for reason in stats.unreported():
                    logger.warning("causalkv paged cache: attention: %s", reason)
                if forced is not None and forced.record is not None:
                    forced.record.append(stats)
                return out[0]
            kc = view.k.view(frames, bs, self.num_kv_heads, self.head_size)  # one transient buffer
            vc = view.v.view(frames, bs, self.num_kv_heads, self.head_size)
            ids = list(range(frames))
        table = torch.tensor([ids + [0] * (width - len(ids))], dtype=torch.int32,
                             device=inputs.block_table.device)
        seq_lens = torch.tensor([frames * bs], dtype=torch.int32, device=inputs.seq_lens.device)
        return ar_diffusion_paged_attention(
            query, kc, vc, block_table=table, query_start_loc=inputs.query_start_loc,
            seq_lens=seq_lens, max_query_len=int(inputs.max_query_len),
            max_seq_len=max(int(inputs.max_seq_len), frames * bs), softmax_scale=softmax_scale)

    def _segment_view(self, layer: int, runs: list[tuple[str, Any, int, int]],
                      key_cache: torch.Tensor, value_cache: torch.Tensor) -> CausalAttentionKVView:
        """One layer's visible K/V of a forward (`_forward_view`'s runs, in the engine's order)
        as a lazy `CausalAttentionKVView` ``[1, rows, H, D]``: ``k``/``v`` one transient buffer
        (pages copied, packed groups decoded in place); ``iter_segments`` one run at a time (a
        run of pages with consecutive ids as views of the pool, else copied; a packed run
        decoded); ``iter_stored_segments`` the same with packed runs as their codec records
        (nothing decoded). Its positions are the rows ``[0, rows)``: LingBot's paged attention
        is unmasked, only the order matters."""
        bs, H, D = key_cache.shape[1], self.num_kv_heads, self.head_size
        dev = key_cache.device

        def buffer(sel: Sequence[tuple[str, Any, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
            k = torch.empty((1, sum(hi - lo for _, _, lo, hi in sel), H, D), dtype=key_cache.dtype, device=dev)
            v = torch.empty_like(k)
            at = 0
            for kind, what, lo, hi in sel:
                k_run, v_run = k[:, at:at + hi - lo], v[:, at:at + hi - lo]  # the run's rows, in place
                if kind == "page":
                    idx = torch.tensor(what, dtype=torch.long, device=dev)
                    torch.index_select(key_cache, 0, idx, out=k_run.view(-1, bs, H, D))
                    torch.index_select(value_cache, 0, idx, out=v_run.view(-1, bs, H, D))
                else:
                    what.layers[layer].storage.read_into(lo, hi, 0, H, k_run, v_run, dev)
                at += hi - lo
            return k, v

        def piece(run: tuple[str, Any, int, int], stored: bool) -> Any:
            kind, what, lo, hi = run
            if kind == "packed" and stored:
                part = what.layers[layer].storage.onloaded(dev).select_tokens(lo, hi)
                return part.k, part.v
            if kind == "page" and what == list(range(what[0], what[0] + len(what))):
                a, b = what[0], what[0] + len(what)
                return (key_cache[a:b].view(1, -1, H, D), value_cache[a:b].view(1, -1, H, D))
            return buffer([run])

        rows = sum(hi - lo for _, _, lo, hi in runs)
        return CausalAttentionKVView(
            position_ranges=((0, rows),), local_start_index=0, local_end_index=rows,
            visible_local_end=rows, visible_global_end=rows, materialize=lambda: buffer(runs),
            segments=lambda: (piece(r, False) for r in runs),
            stored=lambda: (piece(r, True) for r in runs), device=dev)


# -- the engine's seams: the session cache the runner builds, the attention LingBot calls -------
_STOCK_CACHE = _runner.ARDiffusionKVCache
_STOCK_ATTN = _lingbot_transformer.paged_write_attn


def session_cache(config: Any, **kwargs: Any) -> ARDiffusionKVCache:
    """What ``ARDiffusionModelRunner._preallocate_kv_cache`` builds in place of
    ``ARDiffusionKVCache`` once `install_engine_seams` ran: `CausalKVPagedKVCache` when the
    pipeline's spec carries a `CausalKVBranchSpec`, vLLM-Omni's own cache otherwise."""
    ours = [b for b in kwargs.get("kv_branches", ()) if isinstance(b, CausalKVBranchSpec)]
    if not ours:
        return _track(_STOCK_CACHE(config, **kwargs))
    return CausalKVPagedKVCache(config, quant=ours[0].quant, head_offset=ours[0].head_offset, **kwargs)


def paged_write_attn(inputs: Any, query: torch.Tensor, k_curr: torch.Tensor, v_curr: torch.Tensor,
                     k_act: torch.Tensor | None, v_act: torch.Tensor | None,
                     softmax_scale: float) -> torch.Tensor:
    """LingBot's ``paged_write_attn``: a layer of a `CausalKVPagedKVCache` pool is served by
    `CausalKVPagedKVCache.attend`; any other by vLLM-Omni's own."""
    for cache in live_caches():
        for layer, pool in enumerate(cache._k_pools):
            if pool is inputs.key_pool:
                return cache.attend(layer, inputs, query, k_curr, v_curr, k_act, v_act,
                                    softmax_scale)
    return _STOCK_ATTN(inputs, query, k_curr, v_curr, k_act, v_act, softmax_scale)


def install_engine_seams() -> None:
    """Point the two engine seams at causalkv (idempotent; this process): the runner builds
    `session_cache`, LingBot's self-attention calls `paged_write_attn`. Both behave as
    vLLM-Omni's own for every pipeline that does not ask for causalkv's pages."""
    _runner.ARDiffusionKVCache = session_cache
    _lingbot_transformer.paged_write_attn = paged_write_attn
