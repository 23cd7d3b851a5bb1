"""The cache contract as a state machine: `QVGPackedCausalKVCache` against `DenseCausalKVCache`.

tests/cache_machine.py is the machine (ops, checks, the codec bound, the protocol model);
this module is causalkv's environment: per layer a dense cache (the reference) and a packed
cache (quant off / int4 / int2), both given the same marks: as call arguments (``probe=True``,
``commit=Commit(...)``) or through one `PassMarker` every cache uses (``use_marker``).
`EXAMPLES` runs (500; ``CAUSALKV_MACHINE_EXAMPLES`` for more, see tests/README.md) of up to
`STEPS` ops each. Zero refusals of a call the dense cache accepts: the machine fails on any.
"""

from __future__ import annotations

import torch
from cache_machine import (
    DT,
    EXAMPLES,
    STEPS,
    B,
    Config,
    D,
    Env,
    Stats,
    assert_values,
    cursors,
    machine_settings,
    make_machine,
)
from hypothesis import strategies as st

from causalkv.caches import CausalCacheSpec, DenseCausalKVCache, PassMarker, attend
from causalkv.caches import intervals as iv
from causalkv.caches.attention import AttendError, attend_dense
from causalkv.caches.qvg import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.qvg.segments import DecodedKV


@st.composite
def configs(draw: st.DrawFn) -> Config:
    chunk = draw(st.sampled_from([8, 16, 16, 24, 32]))
    sink = draw(st.sampled_from([0, chunk]))
    slots = draw(st.integers(2, 4))
    cfg = Config(
        layers=draw(st.integers(1, 3)),
        heads=draw(st.sampled_from([2, 4])),
        block=draw(st.sampled_from([32, 64])),
        chunk=chunk,
        slots=slots,
        sink=sink,
        global_sink=draw(st.sampled_from([0, sink])),
        window=None,
        growth=draw(st.integers(0, 3)) == 0,
        bits=draw(st.sampled_from([None, 4, 2])),
        keep_recent=draw(st.integers(0, 1)),
        quant_sink=draw(st.booleans()),
        marks=draw(st.sampled_from(["args", "marker"])),
    )
    if draw(st.booleans()):
        cfg.window = cfg.cache_size - draw(st.sampled_from([0, chunk // 2, chunk]))
    return cfg


class CausalkvEnv(Env):
    name = "causalkv"

    def configs(self) -> st.SearchStrategy[Config]:
        return configs()

    def build(self, cfg: Config):
        spec = CausalCacheSpec(
            batch_size=B, num_heads=cfg.heads, head_dim=D, cache_size=cfg.cache_size,
            sink_tokens=cfg.sink, global_sink_tokens=cfg.global_sink,
            attention_window_size=cfg.window, dtype=DT, allow_growth=cfg.growth,
        )
        quant = (QVGKVQuantArgs() if cfg.bits is None else QVGKVQuantArgs(
            codec=f"int{cfg.bits}", centroids=4, block_size=cfg.block, keep_recent_chunks=cfg.keep_recent,
            sink=cfg.quant_sink))
        marker = PassMarker() if cfg.marks == "marker" else None
        subs = [QVGPackedCausalKVCache(spec, quant, marker=marker) for _ in range(cfg.layers)]
        refs = [DenseCausalKVCache(spec) for _ in range(cfg.layers)]
        for ref in refs:
            ref.use_marker(marker)
        return refs, subs, marker

    def global_end(self, ref) -> int:
        return ref.global_end

    def positions(self, view) -> list[int]:
        return view.positions.tolist()

    def read(self, cache, recent):
        return cache.get_attention_kv(recent_window_tokens=recent)

    def extra_state(self, cache) -> tuple:
        return (cache.global_end, cache.state.pinned)

    def check_view(self, cfg: Config, got, want, q: torch.Tensor, where: str, sub) -> None:
        pos = want.positions.tolist()
        assert got.positions.tolist() == pos, (
            f"{where}: positions {got.position_ranges} != reference {want.position_ranges}")
        assert cursors(got) == cursors(want), f"{where}: cursors {cursors(got)} != {cursors(want)}"
        wk, wv = want.k, want.v
        # what is stored dense is returned bit for bit (before anything materializes the view;
        # a view built as one buffer, a probe's, yields that buffer: decoded rows included),
        # but for the rows of a packed chunk decoded for a write into part of it (`DecodedKV`:
        # the heads a refused half did not rewrite), which carry the codec's error
        decoded = iv.normalize((s.start, s.end) for s in sub.store.segments
                               if isinstance(s.storage, DecodedKV))
        at, lazy = 0, not got.is_materialized
        for pk, pv in got.iter_stored_segments():
            if isinstance(pk, torch.Tensor) and (lazy or cfg.bits is None):
                rows = pk.shape[1]
                span = pos[at:at + rows]  # (a piece past the view's rows fails below)
                bits = cfg.bits if span and iv.intersect(decoded, ((span[0], span[-1] + 1),)) else None
                assert_values(bits, pk,
                              wk[:, at:at + rows], f"{where}: stored dense K rows [{at}, {at + rows})")
                assert_values(bits, pv,
                              wv[:, at:at + rows], f"{where}: stored dense V rows [{at}, {at + rows})")
            else:
                rows = pk.shape[1] if isinstance(pk, torch.Tensor) else pk.shape[2]
            at += rows
        assert at == len(pos), f"{where}: stored pieces hold {at} tokens, the view {len(pos)}"
        segs = list(got.iter_segments())
        n_seg = sum(s[0].shape[1] for s in segs)
        assert n_seg == len(pos), f"{where}: iter_segments yields {n_seg} tokens, the view {len(pos)}"
        if segs:
            sk = torch.cat([s[0] for s in segs], dim=1)
            sv = torch.cat([s[1] for s in segs], dim=1)
            assert_values(cfg.bits, sk, wk, f"{where}: iter_segments K")
            assert_values(cfg.bits, sv, wv, f"{where}: iter_segments V")
        # attention, before view.k/v materialize the window (its own path)
        if not pos:
            try:
                attend(q, got)
            except AttendError:
                pass
            else:
                raise AssertionError(f"{where}: attend on an empty view did not raise AttendError")
        else:
            out = attend(q, got)
            assert out.shape == q.shape, f"{where}: attend shape {tuple(out.shape)}"
            if cfg.bits is None:
                ref_out = attend(q, want)
                assert torch.equal(out, ref_out), (
                    f"{where}: attend differs from the reference's (quant off): max "
                    f"{(out.double() - ref_out.double()).abs().max().item():.4g}")
        gk, gv = got.k, got.v
        assert gk.shape[1] == len(pos), f"{where}: view.k has {gk.shape[1]} tokens, positions {len(pos)}"
        assert_values(cfg.bits, gk, wk, f"{where}: view.k")
        assert_values(cfg.bits, gv, wv, f"{where}: view.v")
        if pos and cfg.bits is not None:
            # attention over exactly the tokens the view shows (float64 over view.k/v)
            # tolerance: two bf16 roundings of outputs below MAX_ABS (2 * 2**-8 * 19), and
            # bf16 SDPA's own rounding on the CPU; leaving out a chunk moves it by units
            exact = attend_dense(q.double(), gk.double(), gv.double())
            err = (out.double() - exact).abs().max().item()
            assert err <= ATTEND_TOL, (
                f"{where}: attend differs by {err:.3f} from attention over the view's own "
                f"{len(pos)} tokens (it must attend over exactly those)")


#: |attend(q, view) - float64 attention over view.k/v| allowed at int4/int2 (see check_view)
ATTEND_TOL = 0.25

STATS = Stats()
Machine = make_machine(CausalkvEnv(), STATS)
TestCacheStateMachine = Machine.TestCase
TestCacheStateMachine.settings = machine_settings(EXAMPLES, STEPS)


def test_examples_ran():
    """Runs after the machine (file order): the runs covered what they are meant to."""
    if STATS.runs == 0:  # the machine test was deselected
        return
    assert STATS.runs >= EXAMPLES
    assert STATS.probes > 0 and STATS.commits > 0 and STATS.unmarked > 0 and STATS.refused_both > 0
    print(f"cache state machine: {STATS}")
