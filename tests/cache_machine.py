"""A differential state machine of the causal KV cache contract, for both environments.

One hypothesis `RuleBasedStateMachine` drives 1-3 layer caches in lock step, as a stage does
(each op applies to every layer in order, and each layer's returned view is checked inside
the op, before the next layer writes): a *reference* dense cache per layer against a
*subject* cache per layer. `Env` says which caches and which semantics:

- tests/test_cache_state_machine.py: causalkv's `DenseCausalKVCache` against
  `QVGPackedCausalKVCache` (quant off or any built-in codec: int4, int2, fp8, nvfp4; a
  recency tier of any of them; spans and shared codebooks of several chunks), both given the
  same marks (call arguments, or one `PassMarker` shared by the layers): the dense cache is
  the contract's answer to a probe and a commit too;
- tests/sglang_bridge/test_bridge_state_machine.py: sglang's own
  ``CausalSelfAttentionKVCache`` against the bridge's ``SGLangQVGKVCache`` allocated as sglang's
  stages allocate them (the bridge's ``allocate`` hook, or exactly its arguments; sglang's
  ``--kv-cache-quant`` int4/int2 with causalkv's codec and recency tier from
  ``CAUSALKV_SGLANG_CODEC`` / ``CAUSALKV_SGLANG_RECENT_TIER``); the bridge's marks come from
  its stage marker, and sglang's cache, which hears none, stores every write: there a commit
  is a promise (the next chunk's size, the pin) the machine keeps.

Ops: unmarked advances by a chunk (sizes drawn, mostly equal) and rewrites of the current
chunk, probes (of a new chunk, again and again, or of the chunk stored last), commits (of the
probed chunk, the chunk stored last, or a new one; telling the next chunk's size or not;
announcing a pin or not, then pinning), head-slice writes (the chunk written as two halves,
a commit complete once both are written), pins, reads between chunks with and without
``recent_window_tokens``, ``reset_indices()`` then a new request, bad calls (a
non-sequential start, a wrong dtype, fewer heads without ``cache_head_start``).

Checks after every op, on every layer's view:

- cursors (and, in causalkv, positions) equal to the reference's; ``view.k``/``view.v``,
  ``iter_segments()`` concatenated and ``attend(q, view)`` agree with the positions (the same
  number of tokens; attention over exactly the tokens the view reports);
- quant off: K/V and attention bit for bit the reference's;
- a codec on: every element within `codec_bound` of the reference's (derived below from the
  codecs' definitions); pieces the view yields stored dense (``iter_stored_segments``) bit
  for bit;
- refusals: when the reference refuses, the subject refuses with an exception of the same
  type; the subject never refuses a call the reference accepts (beyond an environment's
  documented refusal); after every refusal the state is unchanged (the op is not applied to
  the reference, and the next views must still agree).

**Values.** ``key[b, t, h, d] = A * (6 * m + s)`` with ``m = 1 + (layer + h + chunk) % 3`` and
``s = +-1`` a hash of (position, head, write id, layer, d, K or V); the value is the same with
another hash and ``m`` shifted by one. So every value lies in ``[5A, 19A]`` (``MIN_ABS``,
``MAX_ABS``: ``M = 19A``), one chunk's values in one head within ``2A`` (``6m +- 1``, every
channel of a token-head too), a token of another chunk, head or layer is off by at least
``6A - 2A = 4A`` (``10A`` when its ``m`` differs by two), and a stale or misplaced token of
the same chunk by ``2A`` in the channels whose sign differs. Every value is a small integer:
exact in bf16. Which of these a bound tells apart is the table at the end.

**The codec bounds.** Each codec's error is derived from its definition; the decode into the
cache's bf16 adds half an ulp, ``2**-8 * |decoded| <= 2**-8 * (|x| + e)`` (`_rounded`).

- PRQ (int4, int2) stores ``x = c + level * s + e`` per (token, block of channels): ``c`` a
  k-means centroid (a mean of some tokens, stored bf16: within their range widened by
  ``2**-8`` of their largest |x|), ``level`` in ``-q..q`` (``q = 2**(bits-1) - 1``: 1 for int2,
  7 for int4, the reference grid), the scale ``s`` rounded *up* to an e4m3 value (4
  significant bits: ``s <= (1 + 2**-3) * absmax(x - c) / q``) so no code clips and ``|e| <= s
  / 2`` (tests/test_codec.py: test_error_within_half_step_of_stored_scale). So, with ``R``
  the range and ``S`` the largest |x| of the tokens the centroid may come from:

      e <= (1 + 2**-3) / (2 q) * (R + 2**-8 S) + 2**-12 A + 2**-20 (|x| + R)

  (``2**-12 A``: e4m3's flushing of tiny block scales; ``2**-20``: float32 arithmetic). A
  span of one chunk with its own codebook (``span_chunks = codebook_chunks = 1``, and every
  recency-tier pack): within a chunk and head every token comes from one write, so ``R =
  2A`` and ``S = 6m + 1``: int4 about 0.24A, int2 about 1.25A. A span of several chunks, or
  a codebook shared with other spans (``span_chunks`` or ``codebook_chunks`` > 1): the
  centroid may be a mean of tokens of other chunks (the codebook's first span, which may
  have rolled out of the window since), whose values differ from x's by up to the range of
  all values, so ``R = 19A - 5A = 14A`` and ``S = M``: int4 about 1.2A, int2 about 8.0A.
- fp8 (``causalkv/caches/codecs/fp8.py``) stores ``e4m3(x / scale)`` with ``scale = amax /
  448`` per token and head: the quotient is normal here (``>= 448 * 5 / 19``), so rounded to
  3 mantissa bits, ``|e| <= 2**-4 |x|``, plus ``2**-10 * scale`` (half the subnormal step;
  ``amax <= 6m + 1``) and float32 (``2**-22 |x|``): about 1.27A at ``|x| = 19A``, 0.33A at 5A.
- nvfp4 (``causalkv/caches/codecs/nvfp4.py``) stores per block of 16 channels an e2m1 code of
  ``x / s`` with ``s = e4m3(bmax / (6 g)) * g`` (``g`` the record's ``amax / 2688``, ``bmax``
  the block's largest |x|): the scale is normal here (``bmax >= amax / 28672``) and rounded
  to nearest, so ``s <= (1 + 2**-4) bmax / 6``; ``|x / s| <= 6 / (1 - 2**-4) = 6.4``, and
  rounding to the nearest e2m1 magnitude (gaps 0.5, 1, 2: at most 1 off) or saturating at 6
  (at most 0.4 off) leaves ``|e| <= s <= (1 + 2**-4) bmax / 6`` (tighter than the codec's own
  promise, ``bmax / 4``, which adds the two); ``bmax <= 6m + 1``: about 3.45A at ``m = 3``.
  (Any other block: ``amax / 14336``; float32: ``2**-22 |x|``.)
- a recency tier ``t`` under the cache's codec ``c`` (``recent_tier`` another codec): a
  chunk kept for recency (or a sink chunk kept out of ``c``) is packed with ``t``, one chunk
  with its own codebook, and once it leaves recency decoded (into bf16, ``y``, ``|y - x| <=
  e_t``) and re-packed with ``c``, its span included. So ``e <= e_t + e_c(y)``, with ``e_c``
  taken at ``|y| <= |x| + e_t``, the group's largest ``|y|`` widened by the tier's error at
  ``6m + 1`` and the span's range by twice the tier's largest error in it (at ``6m + 1``, or
  at ``M`` in a span of several chunks). A chunk packed with ``c`` directly, or held at the
  tier, is within this too (`Quant.bound` takes the largest of the three); ``t == c`` is
  never re-packed: ``e_c``.

`Quant.bound` is this per element (looked up by |x|: the bounds depend on |x| alone).
What the bound at ``|x| = 19A`` is, and what it tells apart (``sign``: even a stale token of
the same chunk, 2A; ``chunk``: a token of another chunk, 4A; ``far``: one whose ``m`` differs
by two, 10A; ``none``), tier by tier (``bf16``: no tier), one-chunk spans / spans or
codebooks of several chunks (tests/test_cache_state_machine.py's
test_what_the_bound_tells_apart pins the table):

======  ====================  ====================  ====================  ====================  ====================
codec   bf16                  int4                  int2                  fp8                   nvfp4
======  ====================  ====================  ====================  ====================  ====================
int4    sign/sign 0.24/1.21   sign/sign 0.24/1.21   sign/chunk 1.69/2.66  sign/chunk 1.72/2.69  far/far 4.27/5.23
int2    sign/far 1.25/8.02    sign/far 1.76/8.54    sign/far 1.25/8.02    chunk/none 3.95/10.7  far/none 8.62/15.4
fp8     sign 1.27             sign 1.52             chunk 2.60            sign 1.27             far 4.95
nvfp4   chunk 3.45            chunk 3.74            far 4.92              far 4.95              chunk 3.45
======  ====================  ====================  ====================  ====================  ====================

(fp8 and nvfp4 read no codebook: spans leave their bound as it is.) Where a bound tells
less than ``chunk`` (int2 with spans or codebooks of several chunks, a recency tier coarser
than the codec it hands over to), a token of the neighbouring chunk can pass it: there the
machine still tells apart what the table says (``far``: a token two chunks away; ``none``:
no value), and positions (causalkv's views, exactly), cursors, and attention over exactly
the view's tokens; the configurations the machine drew before (int4, int2, one-chunk
spans, no tier) still tell even ``sign``.
"""

from __future__ import annotations

import copy
import functools
import os
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
)

A = 1.0
MAX_ABS = 19 * A  # 6 * 3 + 1
DT = torch.bfloat16
B, D = 1, 64

#: `make test` draws the same examples every run (a red CI is reproducible);
#: ``CAUSALKV_MACHINE_RANDOM=1`` draws new ones (``--hypothesis-seed=N`` then picks them)
DERANDOMIZE = os.environ.get("CAUSALKV_MACHINE_RANDOM", "") != "1"


def machine_size(examples: int, steps: int) -> tuple[int, int]:
    """A contract state machine's examples and ops per example: its defaults in `make test`,
    or ``CAUSALKV_MACHINE_EXAMPLES`` / ``CAUSALKV_MACHINE_STEPS`` for a longer hunt."""
    return (int(os.environ.get("CAUSALKV_MACHINE_EXAMPLES", examples)),
            int(os.environ.get("CAUSALKV_MACHINE_STEPS", steps)))


#: examples per machine in `make test` and ops per example
EXAMPLES, STEPS = machine_size(500, 12)


def machine_settings(examples: int = EXAMPLES, steps: int = STEPS) -> settings:
    """The hypothesis settings every contract state machine runs under (this module's and
    vLLM-Omni's paged one): no deadline, derandomized unless ``CAUSALKV_MACHINE_RANDOM=1``."""
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    derandomize=DERANDOMIZE,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


#: every value the machine writes lies in ``[MIN_ABS, MAX_ABS]`` (``6 m +- 1``, ``m`` in 1..3)
MIN_ABS = 5 * A
#: the range of one chunk's values in one head (``6 m +- 1``), and of all values
RANGE_CHUNK = 2 * A
RANGE_ALL = MAX_ABS - MIN_ABS  # 14A


def _codec_error(name: str, mag: Any, group: Any, rng: Any, span_max: Any, seg_max: Any) -> Any:
    """The codec ``name``'s error before the bf16 rounding of its decode (module docstring):
    ``mag`` bounds ``|x|``, ``group`` the largest ``|x|`` of the element's token-head (fp8's
    scale group, nvfp4's block), ``rng`` the range and ``span_max`` the largest ``|x|`` of
    the tokens its PRQ centroid may come from, ``seg_max`` the largest ``|x|`` of the record."""
    if name in ("int4", "int2"):
        q = 2 ** (int(name[3:]) - 1) - 1
        return ((1 + 2**-3) / (2 * q) * (rng + 2**-8 * span_max) + 2**-12 * A
                + 2**-20 * (mag + rng))
    if name == "fp8":
        return (2**-4 + 2**-22) * mag + 2**-10 * group / 448
    if name == "nvfp4":
        normal = (1 + 2**-4) * (1 + 2**-20) * group / 6
        return torch.maximum(torch.as_tensor(normal, dtype=torch.float64),
                             torch.as_tensor(seg_max / 14336, dtype=torch.float64)) + 2**-22 * mag
    raise AssertionError(f"no bound derived for codec {name!r}")


def _rounded(err: Any, mag: Any) -> Any:
    """``err`` plus the bf16 rounding of the decoded value (half an ulp: ``2**-8`` of
    ``|decoded| <= mag + err``)."""
    return err + 2**-8 * (mag + err)


@dataclass(frozen=True)
class Quant:
    """What packs a run's cold chunks, as the bound needs it (module docstring).

    Attributes:
        codec: the cache's codec setting (``int4``, ``int2``, ``fp8``, ``nvfp4``).
        recent_tier: the recency tier's (``bf16``: none).
        shared: a PRQ centroid may come from tokens of another chunk: spans or codebooks of
            several chunks (``span_chunks`` or ``codebook_chunks`` > 1).
    """

    codec: str
    recent_tier: str = "bf16"
    shared: bool = False

    def __str__(self) -> str:
        tier = "" if self.recent_tier == "bf16" else f"+{self.recent_tier} recent"
        return f"{self.codec}{tier}{' shared' if self.shared else ''}"

    def bound(self, expected: torch.Tensor) -> torch.Tensor:
        """Largest ``|decoded - expected|`` per element (the module docstring's derivation):
        looked up by ``|expected|`` where every value is an integer multiple of ``A`` up to
        `MAX_ABS` (the machine's values, and 0), else computed."""
        mag = expected.abs()
        idx = mag.long()
        if idx.numel() and int(idx.max()) <= MAX_ABS and torch.equal(idx.to(mag.dtype), mag):
            return _bound_table(self)[idx]
        return self.of(mag.double())

    def of(self, mag: torch.Tensor) -> torch.Tensor:
        """The bound at magnitudes ``mag`` (float64)."""
        # the element's chunk's largest value in its head (every channel of the token-head too)
        group = A * (6 * torch.round(mag / (6 * A)) + 1)
        rng, span_max = (RANGE_ALL, MAX_ABS) if self.shared else (RANGE_CHUNK, group)
        main = _rounded(_codec_error(self.codec, mag, group, rng, span_max, MAX_ABS), mag)
        if self.recent_tier in ("bf16", self.codec):
            return main
        t = self.recent_tier  # a recency-tier pack holds one chunk, with its own codebook

        def tier(m: Any, g: Any) -> Any:
            return _rounded(_codec_error(t, m, g, RANGE_CHUNK, g, MAX_ABS), m)

        e_t = tier(mag, group)
        e_group = tier(group, group)  # worst tier error in the element's chunk and head
        e_all = tier(torch.tensor(MAX_ABS, dtype=torch.float64), MAX_ABS)  # in any chunk
        e_span = e_all if self.shared else e_group
        # re-packed at the cache's codec from the tier's decode y: |y - x| <= the tier's error
        mag_y = mag + e_t
        chain = e_t + _rounded(_codec_error(self.codec, mag_y, group + e_group, rng + 2 * e_span,
                                            span_max + e_span, MAX_ABS + e_all), mag_y)
        return torch.maximum(torch.maximum(main, e_t), chain)


@functools.cache
def _bound_table(quant: Quant) -> torch.Tensor:
    """``quant``'s bound at ``|x| = 0, A, ..., MAX_ABS`` (A = 1)."""
    assert A == 1.0
    return quant.of(torch.arange(int(MAX_ABS) + 1, dtype=torch.float64))


def codec_bound(quant: Quant | None, expected: torch.Tensor) -> torch.Tensor:
    """Largest ``|decoded - expected|`` the codec allows per element (module docstring)."""
    if quant is None:
        return torch.zeros_like(expected, dtype=torch.float64)
    return quant.bound(expected)


# ---- values -------------------------------------------------------------------------------
_P = (73856093, 19349663, 83492791, 2654435761, 97531, 104729)


def _signs(pos: torch.Tensor, heads: torch.Tensor, wid: int, layer: int, salt: int) -> torch.Tensor:
    """+-1 ``[n, h, D]``, a hash of (position, head, write id, layer, channel, salt)."""
    d = torch.arange(D, dtype=torch.int64)
    x = (pos.view(-1, 1, 1) * _P[0] + heads.view(1, -1, 1) * _P[1] + (wid * _P[2])
         + layer * _P[3] + d.view(1, 1, -1) * _P[4] + salt * _P[5])
    x = x & 0xFFFFFFFF
    x = (x ^ (x >> 15)) * 0x2C1B3C6D & 0xFFFFFFFF
    x = (x ^ (x >> 12)) * 0x297A2D39 & 0xFFFFFFFF
    x = x ^ (x >> 15)
    return ((x >> 7) & 1).to(torch.float32) * 2 - 1


def chunk_kv(layer: int, chunk: int, start: int, n: int, h0: int, h: int, wid: int,
             dtype: torch.dtype = DT) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[B, n, h, D]`` for positions ``[start, start + n)`` and heads ``[h0, h0 + h)``."""
    pos = torch.arange(start, start + n, dtype=torch.int64)
    heads = torch.arange(h0, h0 + h, dtype=torch.int64)
    m = 1 + (layer + heads + chunk) % 3
    mv = 1 + (layer + heads + chunk + 1) % 3
    k = A * (6 * m.view(1, -1, 1) + _signs(pos, heads, wid, layer, 0))
    v = A * (6 * mv.view(1, -1, 1) + _signs(pos, heads, wid, layer, 1))
    return k.unsqueeze(0).to(dtype), v.unsqueeze(0).to(dtype)


# ---- the environment ------------------------------------------------------------------------
@dataclass
class Config:
    """One run's geometry and caches (drawn once per example)."""

    layers: int
    heads: int
    block: int
    chunk: int
    slots: int
    sink: int
    global_sink: int
    window: int | None
    growth: bool
    codec: str | None  # the codec setting cold chunks are packed with (None: quant off)
    keep_recent: int
    quant_sink: bool
    marks: str  # how marks reach the caches: "args" | "marker" | "hook" (sglang's allocate)
    head_slice: tuple[int, int] | None = None  # sglang: the run's fixed head slice
    int_indices: bool = False
    recent_tier: str = "bf16"  # the recency tier's codec setting (bf16: none)
    span_chunks: int = 1
    codebook_chunks: int = 1
    bits: int | None = None  # sglang: its own selector (its QVGKVQuantArgs.bits)
    #: chunks advanced (unmarked, ``chunk`` tokens each) before the first drawn op: runs whose
    #: spans or codebooks take several cold chunks reach them within ``STEPS`` ops
    prefill: int = 0

    @property
    def cache_size(self) -> int:
        return self.sink + self.slots * self.chunk

    @property
    def quant(self) -> Quant | None:
        """What the bound needs of the run's packing (None: quant off, values exact)."""
        if self.codec is None:
            return None
        return Quant(self.codec, self.recent_tier,
                     shared=self.span_chunks > 1 or self.codebook_chunks > 1)

    def kinds(self) -> list[str]:
        """The kinds of packing this run draws (`Stats.kinds`): its codec, its recency tier's,
        spans and codebooks of several chunks."""
        out = [f"codec={self.codec or 'off'}"]
        if self.recent_tier != "bf16":  # and whether its chunks are re-packed when they leave
            out += [f"tier={self.recent_tier}",
                    "tier=codec" if self.recent_tier == self.codec else "tier re-packed"]
        out += ["span>1"] * (self.span_chunks > 1) + ["codebook>1"] * (self.codebook_chunks > 1)
        return out


class Env:
    """What differs between the two environments (see the module docstring)."""

    name = "abstract"
    #: the reference leaves itself unchanged when it refuses (causalkv's contract; sglang's
    #: cache may roll its buffer before refusing)
    ref_atomic = True
    #: get_attention_kv exists (causalkv's contract; sglang's cache has no read)
    has_reads = True
    #: the head-slice op writes a chunk as two halves (causalkv); else every write uses the
    #: run's fixed ``Config.head_slice`` (sglang's ranks)
    halves = True
    #: the reference gets the marks too (causalkv's dense cache); else it stores every write,
    #: and a commit is a promise the machine keeps (sglang's cache)
    marks_reference = True

    def configs(self) -> st.SearchStrategy[Config]:
        raise NotImplementedError

    def build(self, cfg: Config) -> tuple[list[Any], list[Any], Any]:
        """(references, subjects, the `PassMarker` the caches read marks from, or None: marks
        are call arguments)."""
        raise NotImplementedError

    def global_end(self, ref: Any) -> int:
        raise NotImplementedError

    def positions(self, view: Any) -> list[int] | None:
        return None

    def read(self, cache: Any, recent: int | None) -> Any:
        raise NotImplementedError

    def extra_state(self, cache: Any) -> tuple:
        """Cursors and pin the subject must share with the reference after every op."""
        return ()

    def allowed_extra(self, exc: BaseException) -> bool:
        """A subject refusal the environment documents (the reference accepts the call)."""
        return False

    def after_refusal(self, ref: Any, trial: Any) -> None:
        """The reference refused on ``trial`` (a copy): carry over to ``ref`` what the refusal
        legitimately changes (sglang's cache caches its int cursors on every call)."""

    #: a write that skips positions (the "skip" bad call) after a reset: off where the
    #: reference shows the previous request's leftovers in the skipped slots
    skip_after_reset = True

    def check_view(self, cfg: Config, got: Any, want: Any, q: torch.Tensor, where: str,
                   sub: Any) -> None:
        """``got`` (the view of the subject ``sub``) against the reference's ``want``."""
        raise NotImplementedError


def cursors(view: Any) -> tuple[int, int, int, int]:
    return (view.local_start_index, view.local_end_index, view.visible_local_end,
            view.visible_global_end)


def assert_values(quant: Quant | None, got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """``got`` equals ``want`` (``quant`` None: off, or stored dense) or is within `codec_bound`
    of it."""
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    if quant is None:
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[0].tolist()
            raise AssertionError(f"{where}: element {bad} = {got[tuple(bad)].item()}, "
                                 f"the reference has {want[tuple(bad)].item()} (quant off)")
        return
    err = (got.double() - want.double()).abs()
    bound = codec_bound(quant, want)
    if not bool((err <= bound).all()):
        bad = (err > bound).nonzero()[0].tolist()
        raise AssertionError(
            f"{where}: element {bad} = {got[tuple(bad)].item()}, the reference has "
            f"{want[tuple(bad)].item()}: error {err[tuple(bad)].item():.3f} > {quant} "
            f"bound {bound[tuple(bad)].item():.3f}")


class PackedKinds:
    """The kinds of packed segment a subject's view shows, read from its segment store
    (``store.segments``): ``packed CODEC`` at the cache's codec, ``packed CODEC at the tier``
    (a recency-tier pack to be re-packed), ``packed span of chunks``, ``packed shared
    codebook`` (its codebook tensors held by another segment too), ``re-packed from the
    tier`` (at the cache's codec over positions the store held at the tier when last seen)."""

    def __init__(self) -> None:
        #: per store, the runs it held packed at the recency tier when last seen
        self.tiered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def of(self, store: Any, shown: Sequence[tuple[int, int]] | None = None) -> set[str]:
        """The kinds among the packed segments of ``store`` over positions ``shown`` (None:
        every segment it holds, for views without positions)."""
        from causalkv.caches import intervals as iv

        segs = [s for s in store.segments if s.packed]
        books: dict[int, int] = {}
        for s in segs:
            for t in s.storage.shared_tensors():
                books[id(t)] = books.get(id(t), 0) + 1
        before = self.tiered.get(store, ())
        self.tiered[store] = iv.normalize((s.start, s.end) for s in segs if s.recent)
        kinds: set[str] = set()
        for s in segs:
            run = ((s.start, s.end),)
            if shown is not None and not iv.intersect(run, shown):
                continue
            name = s.storage.codec.name
            if s.recent:
                kinds.add(f"packed {name} at the tier")
                continue
            kinds.add(f"packed {name}")
            if s.last_chunk > s.first_chunk:
                kinds.add("packed span of chunks")
            if any(books[id(t)] > 1 for t in s.storage.shared_tensors()):
                kinds.add("packed shared codebook")
            if iv.intersect(run, before):
                kinds.add("re-packed from the tier")
        return kinds


# ---- the machine ----------------------------------------------------------------------------
@dataclass
class Stats:
    runs: int = 0
    ops: int = 0
    refused_both: int = 0
    probes: int = 0
    commits: int = 0
    unmarked: int = 0
    by_config: dict[str, int] = field(default_factory=dict)
    #: runs per kind of packing drawn (`Config.kinds`): a machine fails if one never ran
    kinds: dict[str, int] = field(default_factory=dict)
    #: views checked per kind of packed segment they showed (`PackedKinds`): a machine fails
    #: if one never showed
    viewed: dict[str, int] = field(default_factory=dict)

    def saw(self, kinds: Any) -> None:
        for kind in kinds:
            self.viewed[kind] = self.viewed.get(kind, 0) + 1


@dataclass
class Stream:
    """What the caller did, as the machine needs it to keep the subject's stream (and, where
    the reference hears no marks, the promises of a commit).

    ``cur_n``: the size of the chunk stored last (None: none since the reset). ``pending``:
    the size of a chunk only probed so far, at the subject's end (the reference, when it hears
    no marks, stored it). ``promise``: after a commit the reference cannot hear, the next
    chunk's size it told (the machine keeps it; the announced pin is made in the same op).
    """

    cur_n: int | None = None
    pending: int | None = None
    promise: int | None = None

    def reset(self) -> None:
        self.cur_n = self.pending = self.promise = None


def make_machine(
    env: Env, stats: Stats, bad_calls: Sequence[str] = ("skip", "dtype", "fewer_heads")
) -> type[RuleBasedStateMachine]:
    """The state machine class for ``env`` (its ``TestCase`` is the pytest test);
    ``bad_calls``: the refused calls it makes."""

    class CacheMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.cfg: Config | None = None

        # ---- setup ------------------------------------------------------------------------
        @initialize(cfg=env.configs())
        def setup(self, cfg: Config) -> None:
            self.cfg = cfg
            self.refs, self.subs, self.marker = env.build(cfg)
            self.stream = Stream()
            self.wid = 0
            self.chunk = -1
            self.resets = 0
            # one thread: the shapes are tiny, and threads only contend (make test runs two
            # workers on two cores); restored in teardown
            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)
            self.log: list[str] = []
            g = torch.Generator().manual_seed(7)
            self.q_full = (torch.randn(B, 2, cfg.heads, D, generator=g) * 0.05).to(DT)
            for _ in range(cfg.prefill):
                self.advance(size="same", other=cfg.chunk, halves=False, recent=None)
            stats.runs += 1
            key = f"{cfg.codec or 'off'} marks={cfg.marks} layers={cfg.layers}"
            stats.by_config[key] = stats.by_config.get(key, 0) + 1
            for kind in cfg.kinds():
                stats.kinds[kind] = stats.kinds.get(kind, 0) + 1

        # ---- helpers ----------------------------------------------------------------------
        def _q(self, h0: int, h1: int) -> torch.Tensor:
            return self.q_full[:, :, h0:h1]

        def _heads(self) -> list[tuple[int | None, int, int]]:
            """The writes of one op per layer: ``(cache_head_start, h0, h1)``."""
            cfg = self.cfg
            if cfg.head_slice is not None:
                return [(cfg.head_slice[0], *cfg.head_slice)]
            return [(None, 0, cfg.heads)]

        def _halves(self) -> list[tuple[int | None, int, int]]:
            h = self.cfg.heads // 2
            return [(0, 0, h), (h, h, self.cfg.heads)]

        def _end(self) -> int:
            """Where the subject's next chunk starts."""
            return env.global_end(self.subs[0])

        def _run(self, kind: str, i: int, call: Callable[[Any], Any], *, check: bool = True,
                 h: tuple[int, int] | None = None) -> bool:
            """``call`` on layer ``i``'s subject and reference (a copy); compare; True when
            both accepted (the reference then adopts the copy)."""
            where = f"layer {i} {kind} after {self.log}"
            try:
                got, exc = call(self.subs[i]), None
            except (ValueError, RuntimeError) as e:
                got, exc = None, e
            # the reference runs on a copy unless it is atomic (then only when the subject
            # refused: the op is then not applied to it)
            trial = (self.refs[i] if env.ref_atomic and exc is None
                     else copy.deepcopy(self.refs[i]))
            try:
                want, ref_exc = call(trial), None
            except (ValueError, RuntimeError) as e2:
                want, ref_exc = None, e2
            stats.ops += 1
            if ref_exc is not None:
                assert exc is not None, f"{where}: the reference refused ({ref_exc!r}), the subject accepted"
                assert isinstance(exc, type(ref_exc)), (
                    f"{where}: the reference refused with {type(ref_exc).__name__} ({ref_exc}), "
                    f"the subject with {type(exc).__name__} ({exc})")
                stats.refused_both += 1
                if env.ref_atomic:  # the reference's own refusal changed nothing either
                    self._same_reference(i, trial, where)
                env.after_refusal(self.refs[i], trial)
                self._after_refusal(i, where)
                return False
            if exc is not None:
                if env.allowed_extra(exc):
                    self._after_refusal(i, f"{where} (refused: {type(exc).__name__}: {exc})")
                    return False
                raise AssertionError(
                    f"{where}: the subject refused what the reference accepts: "
                    f"{type(exc).__name__}: {exc}") from exc
            self.refs[i] = trial
            if check and want is not None and got is not None and h is not None:
                env.check_view(self.cfg, got, want, self._q(*h), where, self.subs[i])
            self._same_state(i, where)
            return True

        def _same_reference(self, i: int, trial: Any, where: str) -> None:
            """The reference that refused on ``trial`` (a copy) still equals the one kept."""
            where = f"{where}: the reference's refusal changed it"
            assert env.extra_state(trial) == env.extra_state(self.refs[i]), where
            if env.has_reads:
                got, want = env.read(trial, None), env.read(self.refs[i], None)
                assert got.position_ranges == want.position_ranges, where
                assert_values(None, got.k, want.k, f"{where}: K")
                assert_values(None, got.v, want.v, f"{where}: V")

        def _same_state(self, i: int, where: str) -> None:
            if self.stream.pending is not None and not env.marks_reference:
                return  # the reference stored the probed chunk, the subject did not (yet)
            assert env.extra_state(self.subs[i]) == env.extra_state(self.refs[i]), (
                f"{where}: state {env.extra_state(self.subs[i])} != reference "
                f"{env.extra_state(self.refs[i])}")

        def _after_refusal(self, i: int, where: str) -> None:
            """A refused op left the subject as it was: it still agrees with the reference."""
            self._same_state(i, f"{where}, after the refusal")
            if env.has_reads:
                self._compare_read(i, None, f"{where}, read after the refusal")

        def _compare_read(self, i: int, recent: int | None, where: str) -> None:
            cfg = self.cfg
            want = env.read(self.refs[i], recent)
            try:
                got = env.read(self.subs[i], recent)
            except (ValueError, RuntimeError) as exc:
                raise AssertionError(f"{where}: read refused: {type(exc).__name__}: {exc}") from exc
            env.check_view(cfg, got, want, self._q(0, cfg.heads), where, self.subs[i])

        def _write(self, kind: str, start: int, n: int, *, chunk: int, recent: int | None,
                   mark: Any = None, halves: bool = False, dtype: torch.dtype = DT,
                   drop_head_start: bool = False) -> list[bool]:
            """One write (or two half writes) per layer, in layer order; ``mark``: None,
            ``"probe"`` or a `CommitPass`."""
            cfg = self.cfg
            self.wid += 1
            parts = self._halves() if halves else self._heads()
            scope = nullcontext()
            marks: dict[str, Any] = {}
            if mark is not None and self.marker is not None:
                scope = (self.marker.probing() if mark == "probe" else
                         self.marker.committing(pin=mark.pin, next_tokens=mark.next_tokens))
            elif mark is not None:
                marks = {"probe": True} if mark == "probe" else {"commit": mark}
            stats.probes += mark == "probe"
            stats.commits += mark is not None and mark != "probe"
            stats.unmarked += mark is None
            ok = []
            with scope:
                for i in range(cfg.layers):
                    for hs, h0, h1 in parts:
                        k, v = chunk_kv(i, chunk, start, n, h0, h1 - h0, self.wid, dtype)

                        def call(c, k=k, v=v, hs=hs, marks=marks):
                            return c.update_and_get_attention_kv(
                                key=k, value=v, current_chunk_start=start,
                                cache_head_start=None if drop_head_start else hs,
                                recent_window_tokens=recent, **marks)

                        ok.append(self._run(kind, i, call, h=(h0, h1)))
            return ok

        def _new_size(self, size: str, other: int) -> int:
            """A new chunk's size: the promised one, else the chunk's (mostly) or another."""
            s = self.stream
            if s.promise is not None:
                return s.promise
            if s.pending is not None:
                return s.pending
            return self.cfg.chunk if size == "same" else other

        # ---- rules ------------------------------------------------------------------------
        @rule(size=st.sampled_from(["same"] * 5 + ["other"]), other=st.integers(8, 32),
              halves=st.booleans(), recent=st.none() | st.sampled_from([0, 8, 24]))
        def advance(self, size: str, other: int, halves: bool, recent: int | None) -> None:
            """An unmarked write of a new chunk (of the probed one when probes came first)."""
            n = self._new_size(size, other)
            halves = halves and env.halves
            self.log.append(f"advance(n={n}{', halves' if halves else ''}, recent={recent})")
            ok = self._write("advance", self._end(), n, chunk=self.chunk + 1, recent=recent,
                             halves=halves)
            if any(ok):
                self.chunk += 1
                self.stream.cur_n, self.stream.pending, self.stream.promise = n, None, None

        @precondition(lambda self: self.cfg is not None and self.stream.cur_n is not None
                      and self.stream.pending is None
                      and (env.marks_reference or self.stream.promise is None))
        @rule(halves=st.booleans(), recent=st.none() | st.sampled_from([0, 8, 24]))
        def rewrite(self, halves: bool, recent: int | None) -> None:
            """An unmarked rewrite of the chunk stored last."""
            n = self.stream.cur_n
            halves = halves and env.halves
            self.log.append(f"rewrite({'halves, ' if halves else ''}recent={recent})")
            self._write("rewrite", self._end() - n, n, chunk=self.chunk, recent=recent,
                        halves=halves)

        @precondition(lambda self: self.cfg is not None)
        @rule(which=st.sampled_from(["new", "new", "new", "current"]),
              size=st.sampled_from(["same"] * 5 + ["other"]), other=st.integers(8, 32),
              halves=st.booleans(), recent=st.none() | st.sampled_from([0, 8, 24]))
        def probe(self, which: str, size: str, other: int, halves: bool,
                  recent: int | None) -> None:
            """A denoising pass, marked: of a new chunk (again and again: nothing is stored),
            or of the chunk stored last (where the reference hears the marks: sglang's cache
            would store the pass, and a later view of that chunk would differ)."""
            s = self.stream
            halves = halves and env.halves
            current = which == "current" and s.cur_n is not None and env.marks_reference
            if current:
                n, start, chunk = s.cur_n, self._end() - s.cur_n, self.chunk
            else:
                n, start, chunk = self._new_size(size, other), self._end(), self.chunk + 1
            self.log.append(f"probe({'current' if current else 'new'}, n={n}"
                            f"{', halves' if halves else ''}, recent={recent})")
            before = s.pending
            if not current and not env.marks_reference:
                s.pending = n  # the reference stores it (sglang's cache hears no marks)
            if not all(self._write("probe", start, n, chunk=chunk, recent=recent, mark="probe",
                                   halves=halves)):
                s.pending = before

        @precondition(lambda self: self.cfg is not None)
        @rule(size=st.sampled_from(["same"] * 5 + ["other"]), other=st.integers(8, 32),
              halves=st.booleans(), pin=st.booleans(), then_pin=st.booleans(),
              tell=st.sampled_from([None, "same", "other"]), nxt=st.integers(8, 32),
              recent=st.none() | st.sampled_from([0, 8]))
        def commit(self, size: str, other: int, halves: bool, pin: bool, then_pin: bool,
                   tell: str | None, nxt: int, recent: int | None) -> None:
            """The chunk's context pass, marked: of the probed chunk, else the chunk stored
            last (where the reference hears the marks), else a new one; telling the next
            chunk's size or not, announcing a pin (then made) or not (``then_pin``: pinned
            anyway, where the reference hears the marks)."""
            from causalkv.caches.passes import CommitPass

            s = self.stream
            halves = halves and env.halves
            new = s.pending is not None or s.cur_n is None or not env.marks_reference
            if new:
                n, start, chunk = self._new_size(size, other), self._end(), self.chunk + 1
            else:
                n, start, chunk = s.cur_n, self._end() - s.cur_n, self.chunk
            told = None if tell is None else n if tell == "same" else nxt
            self.log.append(f"commit({'new' if new else 'current'}, n={n}, next={told}, "
                            f"pin={pin}{', halves' if halves else ''}, recent={recent})")
            ok = self._write("commit", start, n, chunk=chunk, recent=recent,
                             mark=CommitPass(pin=pin, next_tokens=told), halves=halves)
            if all(ok):
                if new:
                    self.chunk += 1
                s.cur_n, s.pending = n, None
                if not env.marks_reference:
                    s.promise = told or n
                if pin or (then_pin and env.marks_reference):
                    self._pin(n)
            elif any(ok) and new:  # some layers took it: the stream went on there
                self.chunk += 1
                s.cur_n, s.pending = n, None

        def _pin(self, n: int) -> None:
            self.log.append(f"pin({n})")
            for i in range(self.cfg.layers):
                self._run("pin", i, lambda c: c.pin_current_chunk(n), check=False)

        @precondition(lambda self: self.cfg is not None and self.stream.pending is None
                      and (env.marks_reference or self.stream.promise is None))
        @rule(which=st.sampled_from(["current", "current", "zero", "one", "more"]))
        def pin(self, which: str) -> None:
            cur = self.stream.cur_n or 0
            n = {"current": cur, "zero": 0, "one": 1, "more": cur + 4}[which]
            self._pin(n)

        @precondition(lambda self: self.cfg is not None and env.has_reads)
        @rule(recent=st.none() | st.sampled_from([0, 4, 16, 40]))
        def read(self, recent: int | None) -> None:
            self.log.append(f"read(recent={recent})")
            for i in range(self.cfg.layers):
                self._compare_read(i, recent, f"layer {i} read after {self.log}")

        @precondition(lambda self: self.cfg is not None)
        @rule()
        def reset(self) -> None:
            self.log.append("reset")
            self.stream.reset()
            for i in range(self.cfg.layers):
                self._run("reset", i, lambda c: c.reset_indices(), check=False)
            self.chunk = -1
            self.resets += 1

        @precondition(lambda self: self.cfg is not None and self.stream.pending is None
                      and (env.marks_reference or self.stream.promise is None))
        @rule(kind=st.sampled_from(list(bad_calls)))
        def bad_call(self, kind: str) -> None:
            """A call the contract refuses; the state must not change."""
            cfg = self.cfg
            end = self._end()
            n = cfg.chunk
            self.log.append(f"bad({kind})")
            if kind in ("skip", "dtype"):
                if kind == "skip" and self.resets and not env.skip_after_reset:
                    return
                ok = self._write("advance", end + 3 if kind == "skip" else end, n,
                                 chunk=self.chunk + 1, recent=None,
                                 dtype=torch.float32 if kind == "dtype" else DT)
                if any(ok):  # the reference accepts it (sglang's cache does): a new chunk
                    self.chunk += 1
                    self.stream.cur_n = n
            else:
                if cfg.heads < 2:
                    return
                self.wid += 1
                h = cfg.heads // 2
                for i in range(cfg.layers):
                    k, v = chunk_kv(i, self.chunk + 1, end, n, 0, h, self.wid)

                    def call(c, k=k, v=v):
                        return c.update_and_get_attention_kv(key=k, value=v,
                                                             current_chunk_start=end)

                    trial = copy.deepcopy(self.refs[i])
                    try:
                        call(trial)
                    except ValueError:
                        pass
                    else:
                        raise AssertionError(
                            f"layer {i} after {self.log}: a write of {h} heads into a cache of "
                            f"{cfg.heads} without cache_head_start was accepted by the "
                            "reference; the contract refuses it (naming cache_head_start)")
                    self._run("advance", i, call, check=False)

        def teardown(self) -> None:
            if self.cfg is not None:
                torch.set_num_threads(self.threads)

    CacheMachine.__name__ = f"CacheMachine_{env.name}"
    return CacheMachine
