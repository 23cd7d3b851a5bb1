"""The cache contract as a state machine: `QVGPackedCausalKVCache` against `DenseCausalKVCache`.

tests/cache_machine.py is the machine (ops, checks, the codec bounds, the protocol model);
this module is causalkv's environment: per layer a dense cache (the reference) and a packed
cache, both given the same marks: as call arguments (``probe=True``, ``commit=CommitPass(...)``)
or through one `PassMarker` every cache uses (``use_marker``). The packed cache draws quant
off or any built-in codec (int4, int2, fp8, nvfp4), a recency tier (``recent_tier``, any of
them, where it holds something: keep-recent 1 or a bf16 sink), and spans and shared
codebooks of several chunks (``span_chunks`` 2-3, ``codebook_chunks`` 2-3, or two spans of
two chunks sharing one codebook; the codebooks PRQ's only), with PRQ's centroids (4) and
block size (32, 64) set only where a PRQ codec reads them. Runs with spans or codebooks of
several chunks get the cache room for them and start with some chunks already advanced
(`Config.prefill`), so the machine reaches them within its ops. `EXAMPLES` runs (500;
``CAUSALKV_MACHINE_EXAMPLES`` for more, see tests/README.md) of up to `STEPS` ops each. Zero
refusals of a call the dense cache accepts: the machine fails on any. `test_examples_ran`
fails when a default run never drew a codec, tier or span kind, or no view showed one packed
(`cache_machine.PackedKinds`).
"""

from __future__ import annotations

import torch
from cache_machine import (
    DERANDOMIZE,
    DT,
    EXAMPLES,
    STEPS,
    B,
    Config,
    D,
    Env,
    PackedKinds,
    Quant,
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

#: the codec settings a run draws (every built-in one) and their recency tiers
CODECS = ("int4", "int2", "fp8", "nvfp4")
PRQ = ("int4", "int2")


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
        codec=draw(st.sampled_from([None, *CODECS])),
        keep_recent=draw(st.integers(0, 1)),
        quant_sink=draw(st.booleans()),
        marks=draw(st.sampled_from(["args", "marker"])),
    )
    if cfg.codec is not None:
        # a recency tier where it holds something (QVGKVQuantArgs.check_used refuses it
        # otherwise): keep-recent chunks, or sink chunks kept out of the cache's codec
        if cfg.keep_recent or not cfg.quant_sink:
            cfg.recent_tier = draw(st.sampled_from(["bf16", *CODECS]))
        # spans of several chunks (one codebook each), codebooks shared by the spans of
        # several chunks, or both: two spans of two chunks sharing one codebook (PRQ's: the
        # other codecs share none)
        shape = draw(st.sampled_from([None, None, "span", "book", "both"] if cfg.codec in PRQ
                                     else [None, None, "span"]))
        if shape is not None:
            if shape == "span":
                cfg.span_chunks = draw(st.integers(2, 3))
            elif shape == "book":
                cfg.codebook_chunks = draw(st.integers(2, 3))
            else:
                cfg.span_chunks, cfg.codebook_chunks = 2, 4
            # room for the chunks that share (a span; two spans of a codebook) besides the
            # current and keep-recent ones
            cold = cfg.span_chunks * (1 if shape == "span" else 2)
            cfg.slots = max(cfg.slots, cold + 1 + cfg.keep_recent)
            # a span is packed within a few advances; a codebook is shared only once the
            # chunks after its first are cold: the run starts there
            cfg.prefill = (draw(st.integers(0, cold)) if shape == "span"
                           else cold + 1 + cfg.keep_recent)
    if draw(st.booleans()):
        cfg.window = cfg.cache_size - draw(st.sampled_from([0, chunk // 2, chunk]))
    return cfg


def quant_args(cfg: Config) -> QVGKVQuantArgs:
    """The run's settings; PRQ's own (centroids, block size) only where a PRQ codec reads them
    (the options refuse a setting no codec in use reads)."""
    if cfg.codec is None:
        return QVGKVQuantArgs()
    prq = {} if not {cfg.codec, cfg.recent_tier} & set(PRQ) else dict(
        centroids=4, block_size=cfg.block)
    return QVGKVQuantArgs(
        codec=cfg.codec, keep_recent_chunks=cfg.keep_recent, sink=cfg.quant_sink,
        recent_tier=cfg.recent_tier, span_chunks=cfg.span_chunks,
        codebook_chunks=cfg.codebook_chunks, **prq)


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
        quant = quant_args(cfg)
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

    def __init__(self) -> None:
        self.packed = PackedKinds()

    def check_view(self, cfg: Config, got, want, q: torch.Tensor, where: str, sub) -> None:
        pos = want.positions.tolist()
        STATS.saw(self.packed.of(sub.store, iv.normalize((p, p + 1) for p in pos)))
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
            if isinstance(pk, torch.Tensor) and (lazy or cfg.codec is None):
                rows = pk.shape[1]
                span = pos[at:at + rows]  # (a piece past the view's rows fails below)
                quant = cfg.quant if span and iv.intersect(decoded, ((span[0], span[-1] + 1),)) else None
                assert_values(quant, pk,
                              wk[:, at:at + rows], f"{where}: stored dense K rows [{at}, {at + rows})")
                assert_values(quant, pv,
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
            assert_values(cfg.quant, sk, wk, f"{where}: iter_segments K")
            assert_values(cfg.quant, sv, wv, f"{where}: iter_segments V")
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
            if cfg.codec is None:
                ref_out = attend(q, want)
                assert torch.equal(out, ref_out), (
                    f"{where}: attend differs from the reference's (quant off): max "
                    f"{(out.double() - ref_out.double()).abs().max().item():.4g}")
        gk, gv = got.k, got.v
        assert gk.shape[1] == len(pos), f"{where}: view.k has {gk.shape[1]} tokens, positions {len(pos)}"
        assert_values(cfg.quant, gk, wk, f"{where}: view.k")
        assert_values(cfg.quant, gv, wv, f"{where}: view.v")
        if pos and cfg.codec is not None:
            # attention over exactly the tokens the view shows (float64 over view.k/v)
            # tolerance: two bf16 roundings of outputs below MAX_ABS (2 * 2**-8 * 19), and
            # bf16 SDPA's own rounding on the CPU; leaving out a chunk moves it by units
            exact = attend_dense(q.double(), gk.double(), gv.double())
            err = (out.double() - exact).abs().max().item()
            assert err <= ATTEND_TOL, (
                f"{where}: attend differs by {err:.3f} from attention over the view's own "
                f"{len(pos)} tokens (it must attend over exactly those)")


#: what the bound tells apart (tests/cache_machine.py's table), per codec and recency tier:
#: with one-chunk spans, and with spans or codebooks of several chunks
TELLS = {
    "int4": {"bf16": ("sign", "sign"), "int4": ("sign", "sign"), "int2": ("sign", "chunk"),
             "fp8": ("sign", "chunk"), "nvfp4": ("far", "far")},
    "int2": {"bf16": ("sign", "far"), "int4": ("sign", "far"), "int2": ("sign", "far"),
             "fp8": ("chunk", "none"), "nvfp4": ("far", "none")},
    "fp8": {"bf16": ("sign",) * 2, "int4": ("sign",) * 2, "int2": ("chunk",) * 2,
            "fp8": ("sign",) * 2, "nvfp4": ("far",) * 2},
    "nvfp4": {"bf16": ("chunk",) * 2, "int4": ("chunk",) * 2, "int2": ("far",) * 2,
              "fp8": ("far",) * 2, "nvfp4": ("chunk",) * 2},
}


def test_what_the_bound_tells_apart():
    """The bound the machine checks against still tells the tokens of tests/cache_machine.py's
    table apart, at every value the machine writes (``6m +- 1``): ``sign`` a stale token of
    the same chunk (the other sign: 2A off), ``chunk`` a token of another chunk (4A or more),
    ``far`` one whose ``m`` differs by two (10A or more); a looser bound fails here."""
    values = [6.0 * m + s for m in (1, 2, 3) for s in (-1, 1)]
    levels = {"sign": lambda x, y: x != y,
              "chunk": lambda x, y: round(x / 6) != round(y / 6),
              "far": lambda x, y: abs(round(x / 6) - round(y / 6)) == 2}
    for codec, tiers in TELLS.items():
        for tier, claims in tiers.items():
            for shared, claim in zip((False, True), claims):
                quant = Quant(codec, tier, shared)
                bound = quant.bound(torch.tensor(values, dtype=DT)).tolist()
                told = [name for name, other in levels.items()
                        if all(abs(x - y) > b for x, b in zip(values, bound)
                               for y in values if other(x, y))]
                assert (told[0] if told else "none") == claim, (
                    f"{quant}: the bound {max(bound):.2f} tells apart {told}, the table {claim}")


#: |attend(q, view) - float64 attention over view.k/v| allowed at int4/int2 (see check_view)
ATTEND_TOL = 0.25

STATS = Stats()
Machine = make_machine(CausalkvEnv(), STATS)
TestCacheStateMachine = Machine.TestCase
TestCacheStateMachine.settings = machine_settings(EXAMPLES, STEPS)


def test_examples_ran():
    """Runs after the machine (file order): the runs covered what they are meant to: every
    codec, recency tiers (re-packed or not), spans and codebooks of several chunks drawn, and
    (the derandomized run) views that showed each of them packed."""
    if STATS.runs == 0:  # the machine test was deselected
        return
    assert STATS.runs >= EXAMPLES
    assert STATS.probes > 0 and STATS.commits > 0 and STATS.unmarked > 0 and STATS.refused_both > 0
    print(f"cache state machine: {STATS}")
    if EXAMPLES < 500:  # a shorter run (CAUSALKV_MACHINE_EXAMPLES) need not cover every kind
        return
    drawn = {f"codec={c}" for c in ("off", *CODECS)} | {f"tier={c}" for c in CODECS} | {
        "tier=codec", "tier re-packed", "span>1", "codebook>1"}
    assert drawn <= set(STATS.kinds), f"never drawn: {sorted(drawn - set(STATS.kinds))}"
    if not DERANDOMIZE:  # new examples cluster (a few configs, many op sequences): the
        return  # counts above say what their views showed; `make test`'s run must show all
    shown = {f"packed {c}" for c in CODECS} | {
        "packed span of chunks", "packed shared codebook", "re-packed from the tier"} | {
        f"packed {c} at the tier" for c in CODECS}
    assert shown <= set(STATS.viewed), f"no view showed: {sorted(shown - set(STATS.viewed))}"
