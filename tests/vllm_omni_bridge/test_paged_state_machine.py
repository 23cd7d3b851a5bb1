"""causalkv's paged cache as a state machine: `CausalKVPagedKVCache` against vLLM-Omni's own
``ARDiffusionKVCache``, call for call, no engine and no weights.

Both caches are built as vLLM-Omni's runner builds them (``ARDiffusionModelRunner.
_preallocate_kv_cache``: an ``ARDiffusionKVConfig``, the spec's geometry, ``device`` CPU; the
stock one with vLLM-Omni's branch spec, causalkv's with a `CausalKVBranchSpec` carrying the QVG
settings) at a tiny geometry: 2 layers x 2 heads x 64 channels, float32 pages, 4 tokens per
frame, ``frames_per_block`` 1-3 frames per tick, a sink of 0-2 ticks and a window of 1-3 ticks,
each given the memory three of its own sessions need (so each pool is as tight as admission
makes it), or that and two ticks of pool pages more (so a committing forward of up to three
ticks fits either pool; the session cap stays three). Each session is vLLM-Omni's own
``ARDiffusionKVState`` on each cache (the runner's ``_new_session_state``:
``begin_request("ar::NAME::main")``), and each forward is what LingBot-World's DMD block runner
does: ``state.get_kv_caches(branch, seq_len, commit_current)``, ``forward_ctx.prepare``, then
per layer the module global LingBot's self-attention calls,
`causalkv.vllm_omni.paged_cache.paged_write_attn` (as `install_engine_seams` leaves it:
causalkv's pools served by `CausalKVPagedKVCache.attend` under ``cache.binding(state)``, as the
pipeline binds a session per invocation, the stock's by vLLM-Omni's own op), with the same
random Q/K/V for both caches; a tick's four probe forwards run on scratch pages, its committing
forward on pool pages, then ``state.commit_paged_context``.

Two machines run the same rules: `PagedMachine` over LingBot's settings on the engine (off,
int4, int2, int2 with 2-tick spans, int2 with a bf16 sink), `CodecMachine` over the other codecs
and tiers causalkv's paged cache takes through `CausalKVBranchSpec`'s QVG settings (fp8;
nvfp4; int2 with its keep-recent tick at an int4 recency tier, re-packed at int2 from there;
nvfp4 with an fp8 recency tier holding the sink too; int2 sharing one codebook over three
ticks), so each setting is drawn in every run (`QUANTS`).

Rules (hypothesis draws them, up to three sessions interleaved): open a session; a probe
forward or the committing forward of a session, of one tick or (a single forward) of two or
three (LingBot's forwards are one tick each; vLLM-Omni's state and cache take any whole number
of frames in one forward and commit them frame by frame, causalkv settling at each tick's end);
commit a session's tick (also with nothing to commit: a no-op in both); close a session (close,
LRU eviction and a failed forward are one release path in the runner); reset a session
(``state.reset()``: the same request id reopened); bad calls: a forward while the session's
committing forward is not committed, a forward of a closed session, a probe larger than the
scratch pages, ``allocate_token_slots(adapter, 0)``; and two calls the stock accepts and
causalkv documents it refuses (`ConfigError`): a session opened with a prefill prefix
(LingBot-World has none), and a forward of part of a tick, a probe of fewer frames or a
committing forward ending inside a tick (LingBot's transformer takes whole ticks, and causalkv
settles a session at a tick's end for a next forward of whole ticks; a refused committing
forward closes the session in both, as the runner releases a failed forward).

The oracles, after every forward, on every layer:

- **the machine's own model** of each session (the K/V it wrote and committed, its own only):
  a forward reads the sink frames, then the newest frames, its own last, ``sink + window``
  frames at most (vLLM-Omni's ``video_block_table`` rule). The stock's visible K/V (its block
  table's pages, read from its pool) equal the model's bit for bit: so the model is the
  engine's, and the stock's output depends on the session's own writes only;
- **quant off**: causalkv's output equals the stock's bit for bit (the same pages, in the same
  order, through the same kernel), so it mixes no sessions either;
- **a codec on**: the K/V causalkv's attention reads (`_forward_view` / `_segment_view`, the
  view the attention is computed over) are the model's visible frames in the model's order:
  pool pages bit for bit, packed groups within their codec's own bound (``KVCodec.error_bound``
  of the group's input, as tests/vllm_omni_bridge/test_paged_engine.py checks it at the store).
  The input is noted after each of causalkv's frame commits, from the groups it packed there
  (`PagedMachine._note_packs`): the model's K/V of the group's frames; for frames held at the
  recency tier before, their decode there (a re-pack starts from it; that decode is itself
  checked within the tier codec's bound of the frames); for a group that joined another's
  codebook, both groups' inputs together (its centroids come from the first). The output is
  float64 attention over that view within `ROUND` (float32 rounding), and float64 attention
  over the stock's K/V within the perturbation bound the codec's bound (plus the input's
  distance from the frames written) implies (`attention_bound`); half these examples route
  packed groups through `causalkv.caches.attend` (`forced_route`, the CUDA path's decode
  route, on the CPU).

After every op: each cache's free blocks are its initial count less the pages its open sessions
hold (after a close or reset, a session's pages are back in the pool); causalkv holds no more
pages per session than the stock; causalkv's records are exactly the open sessions. Refusals: a
call the stock refuses, causalkv refuses with the same exception type and both are unchanged
(block tables, free blocks, adapters' positions, causalkv's records); causalkv refuses nothing
the stock accepts beyond those documented refusals (causalkv unchanged by them), and a pool
exhausted by a forward of several ticks: each pool keeps one tick in flight beyond its full
sessions (plus one page), the engine's rule and causalkv's admission, and a forward of more
runs on what the sessions leave free. causalkv's sessions hold fewer pages in a smaller pool,
so either cache may find its pool exhausted where the other does not (vLLM-Omni's own
``RuntimeError``): allowed when that cache had fewer free pages than the forward needs (and,
for causalkv, more than the tick admission reserves), causalkv left unchanged; then, as the
runner does with a failed forward, the session is closed in both.

`EXAMPLES` examples of each machine (``CAUSALKV_MACHINE_EXAMPLES``), `STEPS` ops each,
derandomized unless ``CAUSALKV_MACHINE_RANDOM=1`` (tests/cache_machine.py's conventions;
tests/README.md). What a derandomized run draws shifts with any change to the rules, so the
reads each setting of `CodecMachine` makes (a recency-tier group, a group re-packed from the
tier, a group joining another's codebook, after committing forwards of two ticks) are also
driven by one fixed stream per setting through the same checks (`test_codec_stream`).

Left out: several sessions each holding an uncommitted committing forward (the runner runs one
request at a time, and causalkv's pool counts one in-flight tick; the stock's slack serves more).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from cache_machine import machine_settings, machine_size
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

#: examples in `make test` and ops per example (``CAUSALKV_MACHINE_EXAMPLES`` /
#: ``CAUSALKV_MACHINE_STEPS`` for a longer run)
EXAMPLES, STEPS = machine_size(50, 30)

LAYERS, HEADS, HEAD_DIM, TOKENS_PER_FRAME = 2, 2, 64, 4
DTYPE = torch.float32
SCALE = HEAD_DIM**-0.5
#: sessions each cache admits (the memory it is given) and the machine opens at most
CAPACITY = 3
NAMES = ("a", "b", "c")
BRANCH = "main"
#: |float32 attention - float64 attention| allowed, relative to the largest |V| read: a
#: float32 softmax-weighted sum of at most (sink + window) x 4 = 60 rows (each product and
#: partial sum rounded at 2**-24 relative) is within 60 x 2**-24 ~ 4e-6 of exact
ROUND = 2e-5
#: Q's scale: scores of order 0.1, so the codec's bound on K moves the softmax a little (the
#: bound on the output stays meaningful, see `attention_bound`)
Q_SCALE = 0.05

#: the QVG settings drawn (every codec the paged cache takes, each tier, spans, shared
#: codebooks): off; the engine tests' int4 / int2 (keep-recent 1, sink packed); int2 with
#: 2-tick spans and no keep-recent (a span outliving its older tick); int2 with a bf16 sink;
#: fp8 and nvfp4; int2 with its keep-recent tick at an int4 recency tier (re-packed at int2
#: from the tier once it leaves recency); nvfp4 with an fp8 recency tier holding the sink too
#: (``sink=False``); int2 sharing one codebook over 3 ticks (the later ticks only assign to the
#: first's centroids)
QUANTS: dict[str, dict[str, Any]] = {
    "off": {},
    "int4": {"codec": "int4"},
    "int2": {"codec": "int2"},
    "int2-span2": {"codec": "int2", "keep_recent_chunks": 0, "span_chunks": 2},
    "int2-bf16-sink": {"codec": "int2", "sink": False},
    "fp8": {"codec": "fp8"},
    "nvfp4": {"codec": "nvfp4", "keep_recent_chunks": 0},
    "int2-recent-int4": {"codec": "int2", "recent_tier": "int4"},
    "nvfp4-recent-fp8-sink": {"codec": "nvfp4", "recent_tier": "fp8", "sink": False},
    "int2-codebook3": {"codec": "int2", "keep_recent_chunks": 0, "codebook_chunks": 3},
}
#: the two machines' settings: LingBot's on the engine (`PagedMachine`), the other codecs and
#: tiers (`CodecMachine`); each machine runs `EXAMPLES` examples, so each setting is drawn
LINGBOT_QUANTS = ("off", "int4", "int2", "int2-span2", "int2-bf16-sink")
#: (hypothesis draws the first of a list in its shortest examples, and the last seldom: the
#: settings with the most state in the middle)
CODEC_QUANTS = ("fp8", "int2-codebook3", "int2-recent-int4", "nvfp4-recent-fp8-sink", "nvfp4")


@dataclass
class Stats:
    runs: int = 0
    ops: int = 0
    forwards: int = 0
    commits: int = 0
    closes: int = 0
    packed_reads: int = 0
    by_machine: dict[str, int] = field(default_factory=dict)
    refused_both: int = 0
    documented: int = 0
    #: committing forwards of several ticks, and those the stock's / causalkv's pool could
    #: not hold (the other's could)
    multi_tick: int = 0
    pool_refusals: tuple[int, int] = (0, 0)
    #: packed runs read: at a recency tier, re-packed from one, joining another group's codebook
    tier_reads: int = 0
    repacked_reads: int = 0
    book_reads: int = 0
    by_quant: dict[str, int] = field(default_factory=dict)


STATS = Stats()


@dataclass(frozen=True)
class Geometry:
    fpb: int  # frames per tick
    sink_ticks: int
    window_ticks: int
    quant: str
    routed: bool
    #: ticks of pool pages each cache is given beyond its `CAPACITY` sessions (0: the pool as
    #: tight as admission makes it; 2: a committing forward of up to 3 ticks fits either pool)
    spare_ticks: int = 0

    @property
    def sink(self) -> int:
        return self.sink_ticks * self.fpb

    @property
    def window(self) -> int:
        return self.window_ticks * self.fpb


@st.composite
def geometries(draw: st.DrawFn, quants: tuple[str, ...]) -> Geometry:
    quant = draw(st.sampled_from(quants))
    sink = draw(st.integers(0, 2))
    window = draw(st.integers(1, 3))  # no sink and one tick: a session holds nothing between ticks
    return Geometry(fpb=draw(st.integers(1, 3)), sink_ticks=sink, window_ticks=window, quant=quant,
                    routed=quant != "off" and draw(st.booleans()), spare_ticks=draw(st.sampled_from((0, 2))))


def build(geo: Geometry) -> tuple[Any, Any, Any]:
    """(stock cache, causalkv's cache, quant): each given the bytes of `CAPACITY` of its own
    sessions (`causalkv.vllm_omni.admission.required_bytes`, the engine's ``_required_bytes``),
    and ``spare_ticks`` ticks of pool pages more (both capped at `CAPACITY` sessions)."""
    from vllm_omni.experimental.ar_diffusion.capability import ARDiffusionKVBranchSpec
    from vllm_omni.experimental.ar_diffusion.kv_cache.config import ARDiffusionKVConfig
    from vllm_omni.experimental.ar_diffusion.kv_cache.manager import ARDiffusionKVCache

    from causalkv.caches.qvg.options import QVGKVQuantArgs
    from causalkv.vllm_omni.admission import causalkv_layout, required_bytes, stock_layout
    from causalkv.vllm_omni.paged_cache import CausalKVBranchSpec, engine_geometry, session_cache

    quant = QVGKVQuantArgs(**QUANTS[geo.quant]).validate()
    config = ARDiffusionKVConfig(enable=True, chunk_size=TOKENS_PER_FRAME, window_chunks=geo.window,
                                 sink_chunks=geo.sink, gpu_memory_fraction=1.0)
    shape = dict(num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=DTYPE,
                 block_size=TOKENS_PER_FRAME, frames_per_block=geo.fpb)
    max_len = 4096
    stock_branch = (ARDiffusionKVBranchSpec(BRANCH, 0),)
    ours = (CausalKVBranchSpec(BRANCH, 0, quant=quant),)
    eng = engine_geometry(config, kv_branches=stock_branch, **shape)
    spare = geo.spare_ticks * geo.fpb * eng.page_bytes
    stock = ARDiffusionKVCache(
        config, max_model_len=max_len, available_bytes=required_bytes(eng, stock_layout(eng), CAPACITY) + spare,
        kv_branches=stock_branch, session_capacity=CAPACITY, device=torch.device("cpu"), **shape)
    # the runner's constructor once install_engine_seams ran (causalkv's for its branch spec)
    sub = session_cache(
        config, max_model_len=max_len,
        available_bytes=required_bytes(eng, causalkv_layout(eng, quant), CAPACITY) + spare,
        kv_branches=ours, session_capacity=CAPACITY, device=torch.device("cpu"), **shape)
    assert type(stock) is ARDiffusionKVCache and type(sub).__name__ == "CausalKVPagedKVCache"
    assert stock.session_capacity == sub.session_capacity == CAPACITY
    for cache in (stock, sub):  # vLLM-Omni's pools are torch.empty: poison what is never written
        for pool in (*cache._k_pools, *cache._v_pools):
            pool.fill_(float("nan"))
    return stock, sub, quant


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 non-causal attention: ``q [n, H, D]`` over ``k``/``v [rows, H, D]``."""
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * SCALE
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v.double())


def attention_bound(q: torch.Tensor, v: torch.Tensor, ek: torch.Tensor, ev: torch.Tensor) -> torch.Tensor:
    """Largest |attention(q, k', v') - attention(q, k, v)| per output element when every
    ``|k' - k| <= ek`` and ``|v' - v| <= ev`` elementwise (``[rows, H, D]``).

    With ``p`` the softmax weights over ``k`` and ``p'`` over ``k'``: each score moves by at most
    ``delta = scale x max_rows sum_d |q_d| ek_d`` (per query and head), so ``p'_i / p_i`` lies in
    ``[e**-2delta, e**2delta]`` and ``sum_i |p'_i - p_i| <= e**2delta - 1``. Then
    ``o' - o = sum_i p'_i (v'_i - v_i) + sum_i (p'_i - p_i)(v_i - c)`` for any ``c`` (the
    weights both sum to 1); with ``c`` the middle of ``v``'s range per channel:
    ``|o' - o| <= max_i ev_i + (e**2delta - 1) x (max_i v_i - min_i v_i) / 2``."""
    delta = torch.einsum("qhd,khd->qhk", q.double().abs(), ek.double()).amax(dim=-1) * SCALE  # [n, H]
    vd = v.double()
    half_range = (vd.amax(dim=0) - vd.amin(dim=0)) / 2  # [H, D]
    return ev.double().amax(dim=0) + torch.expm1(2 * delta).unsqueeze(-1) * half_range


class Session:
    """One session on both caches, and the machine's model of it (its own writes only)."""

    def __init__(self, name: str, stock: Any, sub: Any) -> None:
        from vllm_omni.experimental.ar_diffusion.kv_cache.state import ARDiffusionKVState

        self.name, self.rid = name, f"ar::{name}::main"
        self.states = [ARDiffusionKVState(c, name, {BRANCH: c.begin_request(self.rid)}, num_layers=LAYERS)
                       for c in (stock, sub)]
        #: per committed frame, per layer: (K, V) ``[tokens_per_frame, H, D]``
        self.frames: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        #: the committing forward's frames, until its commit
        self.pending: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self.forget()

    def forget(self) -> None:
        """The record of causalkv's packs (`PagedMachine._note_packs`), emptied."""
        #: per packed group causalkv made: per layer the (K, V) ``[S, H, D]`` its codec was
        #: given, and the group whose codebook it joined (None: its own)
        self.inputs: dict[Any, tuple[list[tuple[torch.Tensor, torch.Tensor]], Any]] = {}
        #: per frame held at the recency tier once: per layer its decoded (K, V), what a
        #: re-pack at the cache's codec is given instead of the frame written
        self.tier: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        #: codebooks by their first tensor: (the tensor, the group that made it)
        self.books: dict[int, tuple[torch.Tensor, Any]] = {}
        #: recency-tier decodes not yet checked against the tier codec's bound
        self.unchecked: list[tuple[range, int, int, torch.Tensor, torch.Tensor, Any]] = []

    def reopen(self) -> None:
        for s in self.states:
            s.reset()
        self.frames, self.pending = [], None
        self.forget()


class PagedMachine(RuleBasedStateMachine):
    #: the QVG settings (`QUANTS`) this machine draws
    quants: tuple[str, ...] = LINGBOT_QUANTS

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.start(data.draw(geometries(self.quants)))

    def start(self, geo: Geometry) -> None:
        """Both caches of ``geo``, no session open."""
        self.geo = geo
        self.stock, self.sub, self.quant = build(geo)
        self.free0 = [c.manager.block_pool.get_num_free_blocks() for c in (self.stock, self.sub)]
        settle = type(self.sub).commit_chunk

        def commit_chunk(adapter: Any) -> None:  # ``commit_paged_context`` calls it per frame
            settle(self.sub, adapter)
            self._note_packs(next(s for s in self.open.values() if s.rid == adapter.request_id))

        self.sub.commit_chunk = commit_chunk
        self.open: dict[str, Session] = {}
        self.closed: list[Session] = []
        self.log: list[str] = []
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny shapes: threads only contend (see tests/README.md)
        STATS.runs += 1
        STATS.by_machine[type(self).__name__] = STATS.by_machine.get(type(self).__name__, 0) + 1
        STATS.by_quant[geo.quant] = STATS.by_quant.get(geo.quant, 0) + 1

    def teardown(self) -> None:
        if hasattr(self, "threads"):
            torch.set_num_threads(self.threads)

    # ---- helpers ------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"{self.geo} after {self.log}"

    def _snapshot(self) -> tuple:
        """Everything a refusal must leave unchanged, in both caches."""
        out = []
        for i, c in enumerate((self.stock, self.sub)):
            sess = []
            for rid, a in sorted(c._adapters.items()):
                sess.append((rid, c.block_table(a), a.completed_chunks, a.compacted_tokens))
            rep = () if i == 0 else tuple((rid, c.report(rid)) for rid in c.sessions())
            out.append((c.manager.block_pool.get_num_free_blocks(), tuple(sess), rep))
        return tuple(out)

    def _check_pools(self) -> None:
        """Free blocks, pages per session, causalkv's records (after every op)."""
        where = self._where()
        held = []
        for c, free0 in zip((self.stock, self.sub), self.free0):
            pages = {s.name: len(c.window_block_ids(s.states[0 if c is self.stock else 1].adapters[BRANCH]))
                     for s in self.open.values()}
            assert set(c._adapters) == {s.rid for s in self.open.values()}, where
            assert free0 - c.manager.block_pool.get_num_free_blocks() == sum(pages.values()), (
                f"{type(c).__name__}: free blocks {c.manager.block_pool.get_num_free_blocks()} != "
                f"{free0} less the open sessions' pages {pages}: {where}")
            held.append(pages)
        for name, pages in held[1].items():
            assert pages <= held[0][name], f"causalkv holds {pages} pages of {name!r}, the stock {held[0][name]}: {where}"
        assert set(self.sub.sessions()) == {s.rid for s in self.open.values()}, where
        for s in self.open.values():
            assert self.sub.report(s.rid).pages == held[1][s.name], where

    def _both(self, what: str, call: Any, *, allowed: type | None = None,
              pages: int = 0) -> tuple[Any, Any] | str | None:
        """``call(stock_side)`` and ``call(causalkv_side)`` (0, 1); refusals compared. Returns
        both results, or None when both refused, or ``"documented"`` when causalkv refused
        with ``allowed`` (its documented refusals; the stock's refusal of the same call, for
        whatever reason, counts as both refusing), causalkv unchanged.

        ``pages``: the pool pages a committing forward allocates. Each pool keeps
        ``frames_per_block + 1`` pages beyond its full sessions (the in-flight tick, the
        engine's rule, which causalkv's admission follows); a forward of more pages runs on what
        the sessions leave, and causalkv's sessions hold fewer pages in a smaller pool. So one
        cache may find its pool exhausted where the other does not: allowed when the forward
        needs more pages than that cache had free (and, for causalkv, more than its admission
        reserves for the in-flight forward), with causalkv unchanged by its refusal. Returns
        ``"pool"`` then: the runner releases a session whose forward failed."""
        self.log.append(what)
        STATS.ops += 1
        before = self._snapshot()
        results, errors = [], []
        for side in (0, 1):
            try:
                results.append(call(side))
                errors.append(None)
            except (ValueError, RuntimeError, AssertionError, KeyError) as exc:
                results.append(None)
                errors.append(exc)
        where = self._where()
        pool = [isinstance(e, RuntimeError) and "pool exhausted" in str(e) for e in errors]
        if pages and pool[0] != pool[1] and (errors[0] is None or errors[1] is None):
            side = pool.index(True)
            free = before[side][0]
            assert pages > free, (
                f"{('the stock', 'causalkv')[side]} found its pool exhausted for {pages} pages with "
                f"{free} free: {where}")
            if side == 1:
                assert pages > self.geo.fpb + 1, (
                    f"causalkv refused a forward of {pages} pages, its admission reserves "
                    f"{self.geo.fpb + 1}: {where}")
                assert self._snapshot()[1] == before[1], f"causalkv's refusal changed it: {where}"
            STATS.pool_refusals = tuple(n + (i == side) for i, n in enumerate(STATS.pool_refusals))
            return "pool"
        if errors[0] is not None and allowed is not None and isinstance(errors[1], allowed):
            errors[0] = errors[1]  # both refuse, causalkv for its documented reason
        if errors[0] is not None:
            assert errors[1] is not None, f"the stock refused ({errors[0]!r}), causalkv accepted: {where}"
            assert type(errors[1]) is type(errors[0]), (
                f"the stock refused with {errors[0]!r}, causalkv with {errors[1]!r}: {where}")
            assert self._snapshot() == before, f"a refusal changed a cache: {where}"
            STATS.refused_both += 1
            return None
        if errors[1] is not None:
            if allowed is not None and isinstance(errors[1], allowed):
                STATS.documented += 1
                assert self._snapshot()[1] == before[1], f"causalkv's refusal changed it: {where}"
                return "documented"
            raise AssertionError(f"causalkv refused what the stock accepts: {errors[1]!r}: {where}") from errors[1]
        return results[0], results[1]

    def _note_packs(self, s: Session) -> None:
        """After each of causalkv's frame commits: what its codec was given for each group it
        packed there (per frame, the K/V written, or for a frame held at the recency tier its
        decode there, which a re-pack starts from), and the group whose codebook it joined (the
        one that made the tensors its record shares). A group at the recency tier is noted
        decoded, to check against the tier codec's bound after the commit."""
        rec = self.sub._records[s.rid]
        frames = s.frames + (s.pending or [])
        bs = TOKENS_PER_FRAME
        for g in rec.groups:
            if not g.packed or g in s.inputs:
                continue
            fs = range(g.start // bs, g.end // bs)
            given = [tuple(torch.cat([(s.tier[f] if f in s.tier else frames[f])[layer][j] for f in fs])
                           for j in (0, 1)) for layer in range(LAYERS)]
            shared = g.layers[0].storage.k.shared_tensors()
            book = None
            if shared:
                book = s.books.setdefault(id(shared[0]), (shared[0], g))[1]
            s.inputs[g] = (given, None if book is g else book)
            if g.layers[0].storage.recent:
                decoded = [g.layers[layer].storage.decoded(torch.device("cpu"), DTYPE) for layer in range(LAYERS)]
                for i, f in enumerate(fs):
                    s.tier[f] = [(d.k[0, i * bs:(i + 1) * bs], d.v[0, i * bs:(i + 1) * bs]) for d in decoded]
                for layer, d in enumerate(decoded):
                    for j, y in enumerate((d.k[0], d.v[0])):
                        s.unchecked.append((fs, layer, j, y, given[layer][j], g.layers[layer].storage.codec))

    def _check_tier(self, s: Session) -> None:
        """Each group packed at the recency tier in the last commit decodes within the tier
        codec's bound of the frames written (what a later re-pack starts from)."""
        for fs, layer, j, y, x, codec in s.unchecked:
            bound = codec.error_bound(x.permute(1, 0, 2).unsqueeze(0))[0].permute(1, 0, 2) * (1 + 1e-6) + 1e-6
            e = (y.double() - x.double()).abs()
            assert bool((e <= bound).all()), (
                f"layer {layer}: {'KV'[j]} of frames {list(fs)} at the recency tier ({codec.name}) off by "
                f"{float((e - bound).max()):.3e} beyond its bound: {self._where()}")
        s.unchecked.clear()

    def _visible(self, s: Session, current: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[int]:
        """The model's visible frames of a forward: indices into ``frames + current``."""
        n = len(s.frames) + len(current)
        limit = self.geo.sink + self.geo.window
        if n <= limit:
            return list(range(n))
        return list(range(self.geo.sink)) + list(range(n - self.geo.window, n))

    # ---- rules ------------------------------------------------------------------------------
    @precondition(lambda self: len(self.open) < CAPACITY)
    @rule(data=st.data())
    def open_session(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([n for n in NAMES if n not in self.open]))
        self.log.append(f"open {name}")
        STATS.ops += 1
        self.open[name] = Session(name, self.stock, self.sub)
        self.closed = [c for c in self.closed if c.name != name]
        self._check_pools()

    def _pick(self, data: st.DataObject) -> Session:
        return self.open[data.draw(st.sampled_from(sorted(self.open)))]

    @precondition(lambda self: self.open)
    @rule(data=st.data(), ticks=st.integers(1, 4), probes=st.integers(0, 2),
          seed=st.integers(0, 2**31 - 1))
    def tick(self, data: st.DataObject, ticks: int, probes: int, seed: int) -> None:
        """1-4 whole ticks of a session as LingBot's DMD block runner runs each: probe forwards
        on scratch pages (``probes`` in the first, one in the others), the committing forward,
        its commit."""
        s = self._pick(data)
        for t in range(ticks):
            for i in range(probes if t == 0 else 1):
                self._forward(s, False, seed + 8 * t + i, self.geo.fpb)
            if not self._forward(s, True, seed + 8 * t + 7, self.geo.fpb):
                return
            self._commit(s)

    # the main rule twice: hypothesis picks among the enabled rules uniformly
    tick_again = tick

    @precondition(lambda self: self.open)
    @rule(data=st.data(), commit=st.booleans(), ticks=st.integers(1, 3), again=st.booleans(),
          fail=st.booleans(), seed=st.integers(0, 2**31 - 1))
    def forward(self, data: st.DataObject, commit: bool, ticks: int, again: bool, fail: bool,
                seed: int) -> None:
        """One forward alone: a probe; or a committing forward of 1-3 ticks (LingBot's are
        one tick; vLLM-Omni's state and cache take any whole number of frames, and commit them
        frame by frame), then (``again``) another forward of the session before its commit
        (both refuse), then its commit, or (``fail``) the release of a failed forward (the
        runner closes the session: the uncommitted pages go). One request is in flight at a
        time (the runner's ``max_num_seqs=1``; causalkv's admission counts one in-flight
        tick), so another session runs only after that."""
        s = self._pick(data)
        if not self._forward(s, commit, seed, (ticks if commit else 1) * self.geo.fpb) or not commit:
            return
        if again:
            self._forward(s, bool(seed & 1), seed + 1, self.geo.fpb)
        if fail:
            self._release(s, reset=False)
        else:
            self._commit(s)

    @rule(data=st.data(), kind=st.sampled_from(["oversized_probe", "closed", "allocate_nothing", "prefill",
                                                "part_of_tick"]),
          seed=st.integers(0, 2**31 - 1))
    def bad_call(self, data: st.DataObject, kind: str, seed: int) -> None:
        """A probe of two ticks (more frames than the scratch pages: both refuse); a forward of
        a closed session (both refuse); ``allocate_token_slots(adapter, 0)`` (both refuse); a
        branch opened with a prefill prefix (the stock opens it, and it is ended again;
        causalkv refuses, documented: LingBot-World has none); a probe of part of a tick, or a
        committing forward of up to 3 ticks ending inside one (the stock takes it; causalkv refuses,
        documented: LingBot's transformer takes whole ticks, and causalkv settles a session for
        a next forward of whole ticks)."""
        fpb = self.geo.fpb
        if kind == "oversized_probe" and self.open:
            self._forward(self._pick(data), False, seed, 2 * fpb)
        elif kind == "part_of_tick" and self.open and fpb > 1:
            commit = bool(seed & 1)
            frames = data.draw(st.integers(1, 3 * fpb if commit else fpb - 1).filter(lambda n: n % fpb))
            self._forward(self._pick(data), commit, seed, frames)
        elif kind == "closed" and self.closed:
            self._forward(data.draw(st.sampled_from(self.closed)), bool(seed & 1), seed, self.geo.fpb)
        elif kind == "allocate_nothing" and self.open:
            s = self._pick(data)
            self._both(f"allocate_token_slots {s.name} 0", lambda side: s.states[side].kv_cache
                       .allocate_token_slots(s.states[side].adapters[BRANCH], 0))
        elif kind == "prefill" and len(self.open) < CAPACITY:
            from causalkv.errors import ConfigError

            def call(side: int) -> Any:
                cache = (self.stock, self.sub)[side]
                adapter = cache.begin_request("ar::prefill::main", prefill_prefix_tokens=TOKENS_PER_FRAME)
                cache.end_request(adapter)

            before = self._snapshot()
            self._both("begin_request with a prefill prefix", call, allowed=ConfigError)
            assert self._snapshot() == before, self._where()
        self._check_pools()

    def _forward(self, s: Session, commit: bool, seed: int, frames: int) -> bool:
        """One forward of ``frames`` frames on both caches, checked (the module docstring).
        False when a pool could not hold it and the session was released."""
        from causalkv.caches.attention import forced_route
        from causalkv.vllm_omni.paged_cache import paged_write_attn

        g = torch.Generator().manual_seed(seed)
        n = frames * TOKENS_PER_FRAME
        qkv = [(Q_SCALE * torch.randn(n, HEADS, HEAD_DIM, generator=g, dtype=DTYPE),
                torch.randn(n, HEADS, HEAD_DIM, generator=g, dtype=DTYPE),
                torch.randn(n, HEADS, HEAD_DIM, generator=g, dtype=DTYPE)) for _ in range(LAYERS)]
        seen: dict[int, Any] = {}

        def run(side: int) -> list[torch.Tensor]:
            state = s.states[side]
            cache = state.kv_cache
            ctxs = state.get_kv_caches(BRANCH, seq_len=n, commit_current=commit)
            ctxs[0].forward_ctx.prepare(torch.device("cpu"), 0, n)
            inputs = [c.to_layer_inputs() for c in ctxs]
            bind = cache.binding(state) if side == 1 else contextlib.nullcontext()
            route = (forced_route(fused=False) if side == 1 and self.geo.routed
                     else contextlib.nullcontext())
            outs = []
            with bind, route:
                for layer, (q, k, v) in enumerate(qkv):
                    outs.append(paged_write_attn(inputs[layer], q, k, v, None, None, SCALE))
                    if side == 1:  # the frames causalkv's attention read (its view, cached per forward)
                        seen[layer] = self._read_view(cache, inputs[layer], layer)
                    else:
                        seen[("stock", layer)] = self._stock_view(cache, inputs[layer])
            return outs

        from causalkv.errors import ConfigError

        got = self._both(f"{'commit-forward' if commit else 'probe'} {s.name} ({frames} frames)", run,
                         pages=frames if commit else 0, allowed=ConfigError if frames % self.geo.fpb else None)
        if got == "pool" or (got == "documented" and commit):  # the runner's release of a failed forward
            self._release(s, reset=False)
            return False
        if got is None or got == "documented":
            return True
        STATS.forwards += 1
        STATS.multi_tick += commit and frames > self.geo.fpb
        stock_out, sub_out = got
        current = [[(k[f * TOKENS_PER_FRAME:(f + 1) * TOKENS_PER_FRAME],
                     v[f * TOKENS_PER_FRAME:(f + 1) * TOKENS_PER_FRAME]) for _, k, v in qkv]
                   for f in range(frames)]
        visible = self._visible(s, current)
        frames_all = s.frames + current
        where = self._where()
        for layer, (q, _, _) in enumerate(qkv):
            want_k = torch.cat([frames_all[f][layer][0] for f in visible])
            want_v = torch.cat([frames_all[f][layer][1] for f in visible])
            sk, sv = seen[("stock", layer)]
            assert torch.equal(sk, want_k) and torch.equal(sv, want_v), (
                f"layer {layer}: the stock's visible K/V are not the model's (frames {visible}): {where}")
            assert bool((stock_out[layer].double() - attention64(q, sk, sv)).abs().max()
                        <= ROUND * float(sv.abs().max())), f"layer {layer}: stock vs float64: {where}"
            if self.geo.quant == "off":
                assert torch.equal(sub_out[layer], stock_out[layer]), (
                    f"layer {layer}: quant off, causalkv's output differs from the stock's "
                    f"by {float((sub_out[layer] - stock_out[layer]).abs().max()):.3e}: {where}")
            self._check_int(s, layer, q, sub_out[layer], seen[layer], visible, sk, sv, where)
        if commit:
            s.pending = current
        self._check_pools()
        return True

    def _stock_view(self, cache: Any, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The stock's visible K/V of a layer: its block table's pages, from its pool."""
        bs = int(inputs.block_size)
        ids = inputs.block_table[0, : int(inputs.seq_lens[0]) // bs].long()
        kc = inputs.key_pool.unflatten(0, (-1, bs))
        vc = inputs.value_pool.unflatten(0, (-1, bs))
        return kc[ids].flatten(0, 1).clone(), vc[ids].flatten(0, 1).clone()

    def _read_view(self, cache: Any, inputs: Any, layer: int) -> tuple:
        """causalkv's view of a layer's forward: its runs, and the K/V they hold (materialized)."""
        bs = int(inputs.block_size)
        runs = cache._forward_view(inputs)
        view = cache._segment_view(layer, runs, inputs.key_pool.unflatten(0, (-1, bs)),
                                   inputs.value_pool.unflatten(0, (-1, bs)))
        return runs, view.k[0].clone(), view.v[0].clone()

    def _check_int(self, s: Session, layer: int, q: torch.Tensor, out: torch.Tensor, seen: tuple,
                   visible: list[int], sk: torch.Tensor, sv: torch.Tensor, where: str) -> None:
        """causalkv's view against the model (pages exact, packed groups within the codec's
        bound), its output against float64 attention over the view and over the stock's K/V.

        A packed group's bound is its codec's ``error_bound`` of what the codec was given
        (`_note_packs`): the frames written, or for frames re-packed from the recency tier
        their decode there; for a group that joined another's codebook, of the two groups'
        inputs together (its centroids are a mean of the first one's tokens, within the range
        of both, which is what the bound of the pair assumes). Against the stock's K/V the
        error is that bound plus the distance from the input to the frames written."""
        runs, k, v = seen
        bs = TOKENS_PER_FRAME
        assert k.shape == sk.shape, f"layer {layer}: causalkv reads {k.shape[0]} rows, the stock {sk.shape[0]}: {where}"
        ek = torch.zeros(k.shape, dtype=torch.float64)
        ev = torch.zeros(k.shape, dtype=torch.float64)
        row = 0
        for kind, what, lo, hi in runs:
            if kind == "page":
                m = len(what) * bs
                assert torch.equal(k[row:row + m], sk[row:row + m]) and torch.equal(v[row:row + m], sv[row:row + m]), (
                    f"layer {layer}: causalkv's pool rows [{row}, {row + m}) are not the visible frames "
                    f"{visible}: {where}")
            else:
                STATS.packed_reads += 1
                m = hi - lo
                first = (what.start + lo) // bs
                want_frames = list(range(first, first + m // bs))
                got_frames = visible[row // bs: (row + m) // bs]
                assert got_frames == want_frames, (
                    f"layer {layer}: a packed run at rows [{row}, {row + m}) holds frames {want_frames}, "
                    f"the forward reads {got_frames} there: {where}")
                assert what in s.inputs, f"layer {layer}: a packed group causalkv made in no commit: {where}"
                given, book = s.inputs[what]
                storage = what.layers[layer].storage
                codec = storage.codec
                span = range(what.start // bs, what.end // bs)
                STATS.tier_reads += storage.recent
                STATS.repacked_reads += any(f in s.tier for f in span) and not storage.recent
                STATS.book_reads += book is not None
                for j, (x, got, err) in enumerate(((sk, k, ek), (sv, v, ev))):
                    inp = given[layer][j]  # [S, H, D]
                    both = inp if book is None else torch.cat([s.inputs[book][0][layer][j], inp])
                    off = both.shape[0] - inp.shape[0]
                    bound = codec.error_bound(both.permute(1, 0, 2).unsqueeze(0))[0].permute(1, 0, 2)
                    bound = bound[off + lo:off + hi] * (1 + 1e-6) + 1e-6
                    e = (got[row:row + m].double() - inp[lo:hi].double()).abs()
                    assert bool((e <= bound).all()), (
                        f"layer {layer}: packed frames {want_frames} ({codec.name}) off by "
                        f"{float((e - bound).max()):.3e} beyond the codec's bound: {where}")
                    err[row:row + m] = bound + (inp[lo:hi].double() - x[row:row + m].double()).abs()
            row += m
        assert row == k.shape[0], where
        if not any(r[0] == "packed" for r in runs):
            return
        vmax = float(torch.maximum(v.abs().max(), sv.abs().max()))
        tol = ROUND * vmax + 1e-6
        d_view = float((out.double() - attention64(q, k, v)).abs().max())
        assert d_view <= tol, f"layer {layer}: output vs float64 over causalkv's view {d_view:.3e} > {tol:.3e}: {where}"
        bound = attention_bound(q, sv, ek, ev) + tol
        d = (out.double() - attention64(q, sk, sv)).abs()
        assert bool((d <= bound).all()), (
            f"layer {layer}: output vs float64 over the stock's K/V beyond the codec-implied bound by "
            f"{float((d - bound).max()):.3e}: {where}")

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """``commit_paged_context`` (with nothing pending: a no-op in both)."""
        self._commit(self._pick(data))

    def _commit(self, s: Session) -> None:
        if self._both(f"commit {s.name}", lambda side: s.states[side].commit_paged_context(BRANCH)) is None:
            return
        if s.pending is not None:
            STATS.commits += 1
            s.frames.extend(s.pending)
            s.pending = None
        self._check_tier(s)
        self._check_pools()

    @precondition(lambda self: self.open)
    @rule(data=st.data(), reset=st.booleans())
    def release(self, data: st.DataObject, reset: bool) -> None:
        """The runner's release: close (also LRU eviction, a failed forward), or a reset (the
        same request id opened again)."""
        self._release(self._pick(data), reset)

    def _release(self, s: Session, reset: bool) -> None:
        self.log.append(f"{'reset' if reset else 'close'} {s.name}")
        STATS.ops += 1
        if reset:
            s.reopen()
        else:
            STATS.closes += 1
            del self.open[s.name]
            for state in s.states:
                state.close()
            self.closed.append(s)
        self._check_pools()


class CodecMachine(PagedMachine):
    """The same machine over the other codecs and tiers causalkv's paged cache takes."""

    quants = CODEC_QUANTS


TestPagedStateMachine = PagedMachine.TestCase
TestPagedStateMachine.settings = machine_settings(EXAMPLES, STEPS)
TestPagedCodecStateMachine = CodecMachine.TestCase
TestPagedCodecStateMachine.settings = machine_settings(EXAMPLES, STEPS)


def test_examples_ran():
    """Runs after the machines (file order): the runs covered what they are meant to."""
    if STATS.runs == 0:  # the machine tests were deselected
        return
    print(f"paged state machine: {STATS}")
    assert STATS.forwards and STATS.commits and STATS.closes and STATS.refused_both and STATS.documented
    assert STATS.packed_reads > 0  # int examples read packed groups
    assert STATS.multi_tick > 0  # committing forwards of several ticks ran (and were read after)
    for machine in (PagedMachine, CodecMachine):
        runs = STATS.by_machine.get(machine.__name__, 0)
        if runs:  # (not deselected)
            assert runs >= EXAMPLES
            assert set(machine.quants) <= set(STATS.by_quant), STATS.by_quant



#: what `test_codec_stream` reads of each setting besides packed groups: groups at the recency
#: tier and re-packed from it, groups joining another's codebook
STREAM_READS = {"fp8": (), "nvfp4": (), "int2-recent-int4": ("tier_reads", "repacked_reads"),
                "nvfp4-recent-fp8-sink": ("tier_reads", "repacked_reads"), "int2-codebook3": ("book_reads",)}


@contextlib.contextmanager
def running(geo: Geometry, *names: str):
    """A `PagedMachine` started on ``geo`` with a session open in both caches under each of
    ``names``, yielded as ``(machine, *sessions)`` and torn down after (a regression test's
    fixed stream, driven through the machine's own checks)."""
    machine = PagedMachine()
    machine.start(geo)
    try:
        for name in names:
            machine.open[name] = Session(name, machine.stock, machine.sub)
        yield (machine, *(machine.open[name] for name in names))
    finally:
        machine.teardown()


@pytest.mark.parametrize("quant", CODEC_QUANTS)
def test_codec_stream(quant):
    """One fixed stream per setting of `CodecMachine`, through the machine's own checks, so
    every run reads what the setting makes whatever the machine's draws: 2 frames per tick,
    sink 1 + window 3 ticks, two ticks of spare pages; session a runs six ticks (a probe, the
    committing forward, its commit), session b between them committing forwards of two ticks
    and probes; then each packed kind the setting makes was read (`STREAM_READS`)."""
    before = dataclasses.replace(STATS)
    geo = Geometry(fpb=2, sink_ticks=1, window_ticks=3, quant=quant,
                   routed=CODEC_QUANTS.index(quant) % 2 == 1, spare_ticks=2)
    with running(geo, "a", "b") as (machine, a, b):
        for t in range(6):
            assert machine._forward(a, False, 10 * t, 2) and machine._forward(a, True, 10 * t + 1, 2)
            machine._commit(a)
            if t % 2 == 0:
                assert machine._forward(b, True, 10 * t + 2, 4)
                machine._commit(b)
            assert machine._forward(b, False, 10 * t + 3, 2)
    assert STATS.multi_tick - before.multi_tick == 3
    for counter in ("packed_reads", *STREAM_READS[quant]):
        assert getattr(STATS, counter) > getattr(before, counter), (counter, STATS)


@pytest.mark.parametrize("quant", ["off", "int2"])
def test_one_tick_window_no_sink(quant):
    """No sink and a window of one tick: a session holds no bytes between ticks (and this
    geometry has no cross-attention or model state), so the memory bounds no session count.
    Both caches are built at the engine's cap (`build` asserts it: ``admit`` divided by the 0
    bytes before); without a cap, ``admit`` refuses naming the cap to pass."""
    from causalkv.errors import ConfigError
    from causalkv.vllm_omni.admission import admit

    geo = Geometry(fpb=2, sink_ticks=0, window_ticks=1, quant=quant, routed=False)
    _, sub, _ = build(geo)
    adm = sub.admission
    assert adm.session_bytes == 0 and adm.capacity == CAPACITY
    with pytest.raises(ConfigError, match="a session holds no bytes between ticks .* pass session_capacity"):
        admit(sub.geometry, adm.layout, available_bytes=10**9)


def test_committing_forward_of_two_ticks():
    """A committing forward of two ticks (outside LingBot's protocol, whose forwards are one
    tick each; vLLM-Omni's state and cache accept it). The stream: one frame per tick, sink 1 +
    window 2; open a session; a committing forward of 2 frames; its commit; a probe: causalkv's
    view is the stock's (`_forward` checks it). causalkv settled the first tick at its last
    frame and gave the second tick's page back to the pool with the rest: the probe's view
    failed with ``KeyError(1)``."""
    with running(Geometry(fpb=1, sink_ticks=1, window_ticks=2, quant="off", routed=False), "a") as (machine, s):
        machine._forward(s, True, 0, 2)
        machine._commit(s)
        machine._forward(s, False, 1, 1)


def test_a_forward_of_part_of_a_tick_is_refused():
    """A forward of part of a tick (outside LingBot's protocol, whose transformer takes exactly
    ``num_frames_per_block`` frames per forward; vLLM-Omni's state and cache take any whole
    number of frames). The stream: 2 frames per tick, no sink, a window of one tick, quant off;
    open a session; a committing forward of one tick; its commit; a probe of 1 frame. The
    stock reads the tick's last frame and the probe's; causalkv had settled the tick for a next
    forward of a whole tick, which reads none of it, and dropped it: its output differed from
    the stock's. causalkv refuses such a forward (`ConfigError`, documented, nothing changed),
    a probe or a committing forward of 3 frames (then the session is closed in both, as the
    runner releases a failed forward)."""
    with running(Geometry(fpb=2, sink_ticks=0, window_ticks=1, quant="off", routed=False), "a") as (machine, s):
        machine._forward(s, True, 0, 2)
        machine._commit(s)
        documented = STATS.documented
        assert machine._forward(s, False, 1, 1)
        assert not machine._forward(s, True, 2, 3)
        assert STATS.documented == documented + 2 and "a" not in machine.open
