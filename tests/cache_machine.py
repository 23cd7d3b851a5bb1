"""A differential state machine of the causal KV cache contract, for both environments.

One hypothesis `RuleBasedStateMachine` drives 1-3 layer caches in lock step, as a stage does
(each op applies to every layer in order, and each layer's returned view is checked inside
the op, before the next layer writes): a *reference* dense cache per layer against a
*subject* cache per layer. `Env` says which caches and which semantics:

- tests/test_cache_state_machine.py: causalkv's `DenseCausalKVCache` against
  `QVGPackedCausalKVCache` (quant off / int4 / int2; no scratch, or one `ChunkScratch`
  shared by the layers, given at construction or through ``use_scratch``);
- tests/sglang_bridge/test_bridge_state_machine.py: sglang's own
  ``CausalSelfAttentionKVCache`` against the bridge's ``SGLangQVGKVCache`` allocated as sglang's
  stages allocate them (the bridge's ``allocate`` hook, or exactly its arguments).

Ops: advance by a chunk (sizes drawn, mostly equal), rewrites of the current chunk (denoising
passes), a context pass (``with scratch.context_pass(pin=...)`` around one write per layer;
a plain write without a scratch), head-slice writes (the chunk written as two halves, also
both inside one context pass), pins (announced by ``context_pass(pin=True)`` or not), reads
between chunks with and without ``recent_window_tokens``, ``reset_indices()`` then a new
request, bad calls (a non-sequential start, a wrong dtype, fewer heads without
``cache_head_start``), and, at the start, ``scratch.share()`` or not.

Checks after every op, on every layer's view:

- cursors (and, in causalkv, positions) equal to the reference's; ``view.k``/``view.v``,
  ``iter_segments()`` concatenated and ``attend(q, view)`` agree with the positions (the same
  number of tokens; attention over exactly the tokens the view reports);
- quant off: K/V and attention bit for bit the reference's;
- int4/int2: every element within `codec_bound` of the reference's (derived below from the
  codec's definition); pieces the view yields stored dense (``iter_stored_segments``) bit
  for bit;
- refusals: when the reference refuses, the subject refuses with an exception of the same
  type; the subject may refuse in addition only as `may_refuse` allows (a shared scratch the
  caller declared, with ``CacheProtocolError``); after every refusal the state is unchanged
  (the op is not applied to the reference, and the next views must still agree).

**Values.** ``key[b, t, h, d] = A * (6 * m + s)`` with ``m = 1 + (layer + h + chunk) % 3`` and
``s = +-1`` a hash of (position, head, write id, layer, d, K or V); the value is the same with
another hash and ``m`` shifted by one. So a token of another chunk, head or layer is off by at
least ``6A - 2A = 4A`` (beyond every bound below), and a stale or misplaced token of the same
chunk by ``2A`` in the channels whose sign differs (beyond the int4 bound, within int2's).
Every value is a small integer: exact in bf16.

**The codec bound.** PRQ stores ``x = c + level * s + e`` per (token, block of channels): ``c``
a k-means centroid of the packed span (a mean of some of its tokens, stored bf16: within the
span's range widened by ``2**-9`` of the largest |x|), ``level`` in ``-q..q`` (``q = 2**(bits-1)
- 1``: 1 for int2, 7 for int4, the reference grid), the scale ``s`` rounded *up* to an e4m3 value
(4 significant bits: ``s <= (1 + 2**-3) * absmax(x - c) / q``) so no code clips and
``|e| <= s / 2`` (tests/test_codec.py: test_error_within_half_step_of_stored_scale). A packed
span is one chunk or a part of one (``span_chunks = codebook_chunks = 1``), and within a chunk
and head every token comes from one write, so ``|x - c| <= 2A + 2**-8 * M`` (``M = 19A`` the
largest |x|). With the bf16 rounding of the decoded value (``2**-8`` relative):

    |decoded - x| <= (1 + 2**-3) / (2 q) * (2A + 2**-8 M) + 2**-8 |x| + 2**-12 A

(the last term covers e4m3's flushing of tiny block scales). int4: about 0.24A; int2: about
1.25A.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

A = 1.0
MAX_ABS = 19 * A  # 6 * 3 + 1
DT = torch.bfloat16
B, D = 1, 64

#: examples per machine in `make test` (``CAUSALKV_MACHINE_EXAMPLES`` for a longer run)
EXAMPLES = int(os.environ.get("CAUSALKV_MACHINE_EXAMPLES", "500"))
STEPS = 12
#: `make test` draws the same examples every run (a red CI is reproducible);
#: ``CAUSALKV_MACHINE_RANDOM=1`` draws new ones (``--hypothesis-seed=N`` then picks them)
DERANDOMIZE = os.environ.get("CAUSALKV_MACHINE_RANDOM", "") != "1"


def codec_bound(bits: int | None, expected: torch.Tensor) -> torch.Tensor:
    """Largest ``|decoded - expected|`` the codec allows per element (module docstring)."""
    if bits is None:
        return torch.zeros_like(expected, dtype=torch.float64)
    q = 2 ** (bits - 1) - 1
    e = expected.double().abs()
    return (1 + 2**-3) / (2 * q) * (2 * A + 2**-8 * MAX_ABS) + 2**-8 * e + 2**-12 * A


def protocol_error() -> type[BaseException] | None:
    """``causalkv.caches.spec.CacheProtocolError`` where it exists (None before it does)."""
    from causalkv.caches import spec

    return getattr(spec, "CacheProtocolError", None)


def is_protocol_refusal(exc: BaseException) -> bool:
    cls = protocol_error()
    return cls is not None and isinstance(exc, cls)


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
    bits: int | None
    keep_recent: int
    quant_sink: bool
    scratch: str  # "none" | "ctor" | "use" | "hook"
    declare: bool  # scratch.share() at the start
    head_slice: tuple[int, int] | None = None  # sglang: the run's fixed head slice
    int_indices: bool = False

    @property
    def cache_size(self) -> int:
        return self.sink + self.slots * self.chunk


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

    def configs(self) -> st.SearchStrategy[Config]:
        raise NotImplementedError

    def build(self, cfg: Config) -> tuple[list[Any], list[Any], Any]:
        """(references, subjects, the shared scratch or None)."""
        raise NotImplementedError

    def global_end(self, ref: Any) -> int:
        raise NotImplementedError

    def held_after_context(self, ref: Any, pin: bool) -> Any:
        """Positions a context pass keeps (what the next same-size advance keeps), or None
        when the environment cannot say (then every read after a context pass may refuse)."""
        return None

    def positions(self, view: Any) -> list[int] | None:
        return None

    def read(self, cache: Any, recent: int | None) -> Any:
        raise NotImplementedError

    def extra_state(self, cache: Any) -> tuple:
        """Cursors and pin the subject must share with the reference after every op."""
        return ()

    def allowed_extra(self, exc: BaseException) -> bool:
        """A subject refusal the environment allows beyond the protocol ones."""
        return False

    def after_refusal(self, ref: Any, trial: Any) -> None:
        """The reference refused on ``trial`` (a copy): carry over to ``ref`` what the refusal
        legitimately changes (sglang's cache caches its int cursors on every call)."""

    #: a write that skips positions (the "skip" bad call) after a reset: off where the
    #: reference shows the previous request's leftovers in the skipped slots
    skip_after_reset = True

    def check_view(self, cfg: Config, got: Any, want: Any, q: torch.Tensor, where: str) -> None:
        raise NotImplementedError


def cursors(view: Any) -> tuple[int, int, int, int]:
    return (view.local_start_index, view.local_end_index, view.visible_local_end,
            view.visible_global_end)


def assert_values(bits: int | None, got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """``got`` equals ``want`` (quant off) or is within `codec_bound` of it."""
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    if bits is None:
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[0].tolist()
            raise AssertionError(f"{where}: element {bad} = {got[tuple(bad)].item()}, "
                                 f"the reference has {want[tuple(bad)].item()} (quant off)")
        return
    err = (got.double() - want.double()).abs()
    bound = codec_bound(bits, want)
    if not bool((err <= bound).all()):
        bad = (err > bound).nonzero()[0].tolist()
        raise AssertionError(
            f"{where}: element {bad} = {got[tuple(bad)].item()}, the reference has "
            f"{want[tuple(bad)].item()}: error {err[tuple(bad)].item():.3f} > int{bits} "
            f"bound {bound[tuple(bad)].item():.3f}")


# ---- the protocol model -------------------------------------------------------------------
@dataclass
class Protocol:
    """What the caller did to the shared scratch, and so which refusals it may get.

    ``declared``: ``scratch.share()`` was called or a context pass opened (sharing on).
    ``plain_last``: the current chunk's last write was not inside a context pass (with 2+
    layers another layer has overwritten its K/V in the scratch since). ``committed``: a
    context pass wrote the current chunk; ``held``: the positions it kept; ``announced``: its
    ``pin`` flag; ``late_pin``: a pin made after it that it did not announce, or a change of
    the announced one.

    The refusals a declared shared scratch allows (`may_refuse`; never without a scratch or
    before the caller declared it, and only as ``CacheProtocolError``):

    - an advance after a chunk whose last write was not a context pass, with 2+ layers;
    - an advance after a context pass by a chunk of another size, or after a late pin that
      needs positions the pass dropped;
    - a read (or a rewrite's view) after such a chunk, or after a context pass when it needs
      positions the pass dropped (``held``: causalkv's environment computes them; sglang's
      cannot, so there any read after a context pass may refuse);
    - a pin after a context pass, other than the one it announced, of positions it dropped.
    """

    shared_scratch: bool
    layers: int
    declared: bool = False
    plain_last: bool = False
    committed: bool = False
    held: Any = None
    announced: bool = False
    late_pin: bool = False
    cur_n: int | None = None

    def new_chunk(self, n: int) -> None:
        self.plain_last = self.committed = self.announced = self.late_pin = False
        self.held, self.cur_n = None, n

    def reset(self) -> None:
        self.new_chunk(0)
        self.cur_n = None

    def on(self) -> bool:
        return self.shared_scratch and self.declared

    def may_refuse(self, kind: str, *, n: int | None = None, needed: Any = None) -> bool:
        """May the subject refuse this op that the reference accepts (CacheProtocolError)?"""
        if not self.on():
            return False
        overwritten = self.layers > 1 and self.plain_last
        if kind == "advance":
            return overwritten or (self.committed and (n != self.cur_n or self.late_pin))
        dropped = self.committed and (needed is None or self.held is None
                                      or not _contains(self.held, needed))
        if kind in ("rewrite", "read"):
            return overwritten or dropped or (self.committed and self.late_pin)
        if kind == "pin":
            return (self.committed and bool(needed) and dropped
                    and not (self.announced and n == self.cur_n))
        return False


def _contains(held: Any, positions: Sequence[int]) -> bool:
    from causalkv.caches import intervals as iv

    return iv.contains(held, iv.normalize((p, p + 1) for p in positions))


# ---- the machine ----------------------------------------------------------------------------
@dataclass
class Stats:
    runs: int = 0
    ops: int = 0
    refused_both: int = 0
    refused_protocol: int = 0
    context_passes: int = 0
    declared_runs: int = 0
    by_config: dict[str, int] = field(default_factory=dict)


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
            self.refs, self.subs, self.scratch = env.build(cfg)
            self.proto = Protocol(shared_scratch=self.scratch is not None, layers=cfg.layers)
            if self.scratch is not None and cfg.declare:
                share = getattr(self.scratch, "share", None)
                assert share is not None, "ChunkScratch.share() does not exist"
                share()
                self.proto.declared = True
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
            stats.runs += 1
            key = f"bits={cfg.bits} scratch={cfg.scratch} layers={cfg.layers}"
            stats.by_config[key] = stats.by_config.get(key, 0) + 1
            stats.declared_runs += cfg.declare

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

        def _check_declared(self) -> None:
            if self.scratch is not None and hasattr(self.scratch, "shared"):
                assert self.scratch.shared == self.proto.declared, (
                    f"scratch.shared is {self.scratch.shared}, the caller "
                    f"{'declared' if self.proto.declared else 'never declared'} sharing")

        def _run(self, kind: str, i: int, call: Callable[[Any], Any], *, n: int | None = None,
                 check: bool = True, h: tuple[int, int] | None = None,
                 may_refuse_extra: bool = False, needed: Any = None) -> bool:
            """``call`` on layer ``i``'s reference (a copy) and subject; compare; True when both
            accepted (the reference then adopts the copy)."""
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
                env.after_refusal(self.refs[i], trial)
                self._after_refusal(i, where)
                return False
            if exc is not None:
                if want is not None and kind in ("rewrite", "read"):
                    needed = env.positions(want)
                allowed = self.proto.may_refuse(kind, n=n, needed=needed) or may_refuse_extra
                if env.allowed_extra(exc):
                    pass
                elif allowed:
                    assert is_protocol_refusal(exc), (
                        f"{where}: a refusal is allowed here (declared shared scratch) but only "
                        f"as CacheProtocolError, got {type(exc).__name__}: {exc}")
                else:
                    raise AssertionError(
                        f"{where}: the subject refused what the reference accepts: "
                        f"{type(exc).__name__}: {exc}") from exc
                stats.refused_protocol += 1
                self._after_refusal(i, f"{where} (refused: {type(exc).__name__}: {exc})")
                return False
            self.refs[i] = trial
            if check and want is not None and got is not None and h is not None:
                env.check_view(self.cfg, got, want, self._q(*h), where)
            assert env.extra_state(self.subs[i]) == env.extra_state(self.refs[i]), (
                f"{where}: state {env.extra_state(self.subs[i])} != reference "
                f"{env.extra_state(self.refs[i])}")
            return True

        def _after_refusal(self, i: int, where: str) -> None:
            """A refused op left the subject as it was: it still agrees with the reference."""
            assert env.extra_state(self.subs[i]) == env.extra_state(self.refs[i]), (
                f"{where}: after a refusal the state {env.extra_state(self.subs[i])} != "
                f"reference {env.extra_state(self.refs[i])}")
            if env.has_reads:
                self._compare_read(i, None, f"{where}, read after the refusal")

        def _compare_read(self, i: int, recent: int | None, where: str) -> None:
            cfg = self.cfg
            want = env.read(self.refs[i], recent)
            try:
                got = env.read(self.subs[i], recent)
            except (ValueError, RuntimeError) as exc:
                if self.proto.may_refuse("read", needed=env.positions(want)):
                    assert is_protocol_refusal(exc), (
                        f"{where}: a read may be refused here, but only as CacheProtocolError, "
                        f"got {type(exc).__name__}: {exc}")
                    return
                raise AssertionError(f"{where}: read refused: {type(exc).__name__}: {exc}") from exc
            env.check_view(cfg, got, want, self._q(0, cfg.heads), where)

        def _write(self, kind: str, start: int, n: int, *, chunk: int, recent: int | None,
                   context: bool = False, pin: bool = False, halves: bool = False,
                   dtype: torch.dtype = DT, drop_head_start: bool = False,
                   extra_refusal: bool = False) -> list[bool]:
            """One write (or two half writes) per layer, in layer order."""
            cfg = self.cfg
            self.wid += 1
            parts = self._halves() if halves else self._heads()
            ctx = (self.scratch.context_pass(pin=pin) if context and self.scratch is not None
                   else nullcontext())
            if context and self.scratch is not None:
                self.proto.declared = True
            ok = []
            with ctx:
                for i in range(cfg.layers):
                    for j, (hs, h0, h1) in enumerate(parts):
                        k, v = chunk_kv(i, chunk, start, n, h0, h1 - h0, self.wid, dtype)
                        # the second half of an advance is a rewrite of the chunk it opened
                        part_kind = "rewrite" if (j > 0 and kind == "advance") else kind

                        def call(c, k=k, v=v, hs=hs):
                            return c.update_and_get_attention_kv(
                                key=k, value=v, current_chunk_start=start,
                                cache_head_start=None if drop_head_start else hs,
                                recent_window_tokens=recent)

                        ok.append(self._run(part_kind, i, call, n=n, h=(h0, h1),
                                            may_refuse_extra=extra_refusal))
            return ok

        # ---- rules ------------------------------------------------------------------------
        @rule(size=st.sampled_from(["same"] * 5 + ["other"]), other=st.integers(8, 32),
              halves=st.booleans(), recent=st.none() | st.sampled_from([0, 8, 24]))
        def advance(self, size: str, other: int, halves: bool, recent: int | None) -> None:
            cfg = self.cfg
            n = cfg.chunk if size == "same" else other
            halves = halves and env.halves
            start = env.global_end(self.refs[0])
            self.log.append(f"advance(n={n}{', halves' if halves else ''}, recent={recent})")
            ok = self._write("advance", start, n, chunk=self.chunk + 1, recent=recent,
                             halves=halves)
            if any(ok):
                self.chunk += 1
                self.proto.new_chunk(n)
                self.proto.plain_last = True

        @precondition(lambda self: self.cfg is not None and self.proto.cur_n is not None)
        @rule(halves=st.booleans(), recent=st.none() | st.sampled_from([0, 8, 24]))
        def rewrite(self, halves: bool, recent: int | None) -> None:
            """A denoising pass: the current chunk again."""
            n = self.proto.cur_n
            if n is None:
                return
            halves = halves and env.halves
            start = env.global_end(self.refs[0]) - n
            self.log.append(f"rewrite({'halves, ' if halves else ''}recent={recent})")
            if any(self._write("rewrite", start, n, chunk=self.chunk, recent=recent, halves=halves)):
                self.proto.plain_last = True

        @precondition(lambda self: self.cfg is not None and self.proto.cur_n is not None)
        @rule(halves=st.booleans(), pin=st.booleans(), then_pin=st.booleans(),
              recent=st.none() | st.sampled_from([0, 8]))
        def context(self, halves: bool, pin: bool, then_pin: bool, recent: int | None) -> None:
            """The chunk's context update (inside ``scratch.context_pass(pin=pin)``), and the
            stage's pin right after it when announced (``then_pin``: also when not)."""
            n = self.proto.cur_n
            if n is None:
                return
            halves = halves and env.halves
            start = env.global_end(self.refs[0]) - n
            self.log.append(f"context(pin={pin}{', halves' if halves else ''}, recent={recent})")
            was_on = self.proto.on()
            ok = self._write("rewrite", start, n, chunk=self.chunk, recent=recent,
                             context=True, pin=pin, halves=halves)
            stats.context_passes += 1
            if all(ok):
                # a later pass of the same chunk cannot bring back what an earlier one dropped
                first = not self.proto.committed
                held = env.held_after_context(self.refs[0], pin)
                if not first and held is not None and self.proto.held is not None:
                    from causalkv.caches import intervals as iv

                    held = iv.intersect(self.proto.held, held)
                self.proto.plain_last = False
                self.proto.announced = pin and (first or self.proto.announced)
                self.proto.committed = True
                self.proto.held = held
            elif any(ok) and not was_on:
                self.proto.plain_last = True
            if pin or then_pin:
                self._pin(n)

        def _pin(self, n: int) -> None:
            self.log.append(f"pin({n})")
            end = env.global_end(self.refs[0])
            size = min(self.cfg.sink, n)
            # the positions the pin keeps (causalkv's contract; sglang's slots differ, but its
            # environment cannot say what a context pass kept, so any late pin may refuse)
            needed = list(range(end - n, end - n + size)) if n > 0 and size > 0 else []
            # after a context pass, a pin it did not announce, or a change of the one it did
            # (another size, or unpinned): what the pass kept was for the announced pin
            late = self.proto.committed and (
                (self.proto.announced and n != self.proto.cur_n)
                or (not self.proto.announced and bool(needed)))
            ok = [self._run("pin", i, lambda c: c.pin_current_chunk(n), check=False, n=n,
                            needed=needed)
                  for i in range(self.cfg.layers)]
            if late and any(ok):  # the stream after it may need positions the pass dropped
                self.proto.late_pin = True

        @precondition(lambda self: self.cfg is not None)
        @rule(which=st.sampled_from(["current", "current", "zero", "one", "more"]))
        def pin(self, which: str) -> None:
            cur = self.proto.cur_n or 0
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
            for i in range(self.cfg.layers):
                self._run("reset", i, lambda c: c.reset_indices(), check=False)
            self.proto.reset()
            self.chunk = -1
            self.resets += 1

        @precondition(lambda self: self.cfg is not None)
        @rule(kind=st.sampled_from(list(bad_calls)))
        def bad_call(self, kind: str) -> None:
            """A call the contract refuses; the state must not change."""
            cfg = self.cfg
            end = env.global_end(self.refs[0])
            n = cfg.chunk
            self.log.append(f"bad({kind})")
            if kind in ("skip", "dtype"):
                if kind == "skip" and self.resets and not env.skip_after_reset:
                    return
                # a write past the end after a context pass: the pass kept what the next advance
                # at the end keeps, so a view of what a gap write keeps instead may be refused
                gap = kind == "skip" and self.proto.on() and self.proto.committed
                ok = self._write("advance", end + 3 if kind == "skip" else end, n,
                                 chunk=self.chunk + 1, recent=None,
                                 dtype=torch.float32 if kind == "dtype" else DT,
                                 extra_refusal=gap)
                if any(ok):  # the reference accepts it (sglang's cache does): a new chunk
                    self.chunk += 1
                    self.proto.new_chunk(n)
                    self.proto.plain_last = True
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
                    self._run("advance", i, call, n=n, check=False)

        def teardown(self) -> None:
            if self.cfg is not None:
                torch.set_num_threads(self.threads)

        @invariant()
        def declared_flag(self) -> None:
            if self.cfg is not None:
                self._check_declared()

    CacheMachine.__name__ = f"CacheMachine_{env.name}"
    return CacheMachine
