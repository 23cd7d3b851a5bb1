"""The cache contract as a state machine in sglang's environment (tests/cache_machine.py).

Per block: sglang's own ``CausalSelfAttentionKVCache`` (the reference, allocated with the
arguments of sglang's ``_allocate_causal_kv_cache``) against the bridge's ``SGLangQVGKVCache``
(quant off, or sglang's ``--kv-cache-quant`` int4/int2 with causalkv's own settings from
the environment: ``CAUSALKV_SGLANG_CODEC`` any built-in codec, int4, int2, fp8 or nvfp4, and
``CAUSALKV_SGLANG_RECENT_TIER`` any of them where it holds something) allocated as sglang's
stages get it: through the bridge's ``allocate`` hook on a LongLive 2.0 stage object (the
blocks share the stage's `PassMarker`; the variables set while it allocates, and the caches'
settings checked), or with exactly that hook's arguments (`bridge_args` of the same settings)
and a marker of its own (quant off, where the hook keeps sglang's own cache). sglang's cache hears no marks: it stores every probe, and the
machine keeps each commit's promise (the next chunk's size, the announced pin), as sglang's
hooked stages do. sglang's semantics: its views (K/V and the four cursors), its cursors and
pin after every op (once the probed chunk is committed: a probe moves no cursor of the
bridge's), its errors (ValueError/RuntimeError as sglang raises them); the bridge may refuse
in addition only with CacheWriteError where its docstring says sglang's dense cache would
leave two versions of a position. Each run uses one head slice (sglang's ranks hold a fixed
one), so the two-halves op of causalkv's machine is off. No spans or codebooks of several
chunks: sglang's ``QVGKVQuantArgs`` has no such field and the bridge reads none from the
environment, so no sglang user can set them (causalkv's machine draws them). PRQ's centroids
and block size are set only where a PRQ codec reads them (the bridge refuses them else).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
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
    Stats,
    assert_values,
    cursors,
    machine_settings,
    make_machine,
)
from hypothesis import strategies as st
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
    CausalSelfAttentionKVCache,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.longlive2 import (
    LongLive2CausalDenoisingStage,
)

from causalkv.caches.passes import PassMarker
from causalkv.caches.spec import CacheWriteError
from causalkv.sglang import ENV_CODEC, ENV_RECENT_TIER
from causalkv.sglang.cache import SGLangQVGKVCache
from causalkv.sglang.settings import EnvSettings, bridge_args
from causalkv.sglang.stages import allocate

#: causalkv's codec settings (``CAUSALKV_SGLANG_CODEC``, ``CAUSALKV_SGLANG_RECENT_TIER``)
CODECS = ("int4", "int2", "fp8", "nvfp4")
PRQ = ("int4", "int2")


@st.composite
def configs(draw: st.DrawFn) -> Config:
    chunk = draw(st.sampled_from([8, 16, 16, 24, 32]))
    sink = draw(st.sampled_from([0, chunk]))
    heads = draw(st.sampled_from([2, 4]))
    bits = draw(st.sampled_from([None, 4, 2]))
    marks = draw(st.sampled_from(["hook", "hook", "direct"]))
    if bits is None:
        marks = "direct"  # the hook keeps sglang's own cache at quant off: its arguments
    cfg = Config(
        layers=draw(st.integers(1, 3)),
        heads=heads,
        block=draw(st.sampled_from([32, 64])),
        chunk=chunk,
        slots=draw(st.integers(2, 4)),
        sink=sink,
        global_sink=draw(st.sampled_from([0, sink])),
        window=None,
        growth=draw(st.integers(0, 3)) == 0,
        codec=None if bits is None else f"int{bits}",
        keep_recent=draw(st.integers(0, 1)),
        quant_sink=draw(st.booleans()),
        marks=marks,
        head_slice=draw(st.sampled_from([None, None, (0, heads // 2), (heads // 2, heads)])),
        int_indices=draw(st.booleans()),
        bits=bits,
    )
    if bits is not None:
        # causalkv's own settings, from the environment (sglang's QVGKVQuantArgs has no codec,
        # tier, span or codebook field): the codec while sglang's bits turn QVG on, and a
        # recency tier where it holds something (the bridge's start-up check refuses it else)
        cfg.codec = draw(st.sampled_from([None, *CODECS])) or cfg.codec
        if cfg.keep_recent or not cfg.quant_sink:
            cfg.recent_tier = draw(st.sampled_from(["bf16", *CODECS]))
    if draw(st.booleans()):
        cfg.window = cfg.cache_size - draw(st.sampled_from([0, chunk // 2, chunk]))
    return cfg


def env_settings(cfg: Config) -> EnvSettings:
    """causalkv's settings of the run as the bridge reads them from the environment (its codec
    None where it is sglang's bits)."""
    return EnvSettings(recent_tier=cfg.recent_tier,
                       codec=None if cfg.codec == f"int{cfg.bits}" else cfg.codec)


@contextmanager
def environment(env: EnvSettings):
    """``CAUSALKV_SGLANG_CODEC`` / ``CAUSALKV_SGLANG_RECENT_TIER`` set to ``env`` (unset where it
    is the default), restored after."""
    values = {ENV_CODEC: env.codec, ENV_RECENT_TIER: None if env.recent_tier == "bf16" else env.recent_tier}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in values.items():
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        yield


def _allocate_args(cfg: Config) -> dict:
    """The keywords sglang's stage passes to ``_allocate_causal_kv_cache``."""
    return dict(
        batch_size=B, kv_cache_size=cfg.cache_size, num_attention_heads=cfg.heads,
        attention_head_dim=D, dtype=DT, device=torch.device("cpu"),
        use_int_indices=cfg.int_indices, sink_tokens=cfg.sink,
        global_sink_tokens=cfg.global_sink,
        attention_window_size=cfg.window or cfg.cache_size, allow_growth=cfg.growth,
    )


class SGLangEnv(Env):
    name = "sglang"
    ref_atomic = False
    has_reads = False
    halves = False
    marks_reference = False

    def configs(self) -> st.SearchStrategy[Config]:
        return configs()

    def build(self, cfg: Config):
        kw = _allocate_args(cfg)
        shape = (B, cfg.cache_size, cfg.heads, D)
        i0 = 0 if cfg.int_indices else None
        refs = [
            CausalSelfAttentionKVCache(
                k=torch.zeros(shape, dtype=DT), v=torch.zeros(shape, dtype=DT),
                global_end_index=torch.zeros(1, dtype=torch.long),
                local_end_index=torch.zeros(1, dtype=torch.long),
                global_end_index_int=i0, local_end_index_int=i0, cache_size=cfg.cache_size,
                sink_tokens=cfg.sink, global_sink_tokens=cfg.global_sink,
                attention_window_size=kw["attention_window_size"], allow_growth=cfg.growth,
            )
            for _ in range(cfg.layers)
        ]
        # PRQ's own settings only where a PRQ codec reads them (the bridge refuses a setting
        # no codec in use reads)
        prq = ({} if not {cfg.codec, cfg.recent_tier} & set(PRQ)
               else dict(centroids=4, block_size=cfg.block))
        quant = (QVGKVQuantArgs() if cfg.bits is None else QVGKVQuantArgs(
            bits=cfg.bits, keep_recent_chunks=cfg.keep_recent, sink=cfg.quant_sink, **prq))
        env = env_settings(cfg)
        if cfg.marks == "hook":
            stage = LongLive2CausalDenoisingStage.__new__(LongLive2CausalDenoisingStage)
            stage.num_transformer_blocks = cfg.layers
            stage._kv_quant_args = quant

            def original(self, **_):
                raise AssertionError("the hook serves quantization itself")

            with environment(env):
                subs = allocate(original, stage, **kw)
            assert all(type(c) is SGLangQVGKVCache for c in subs)
            assert all((c.quant.codec, c.quant.recent_tier) == (cfg.codec, cfg.recent_tier)
                       for c in subs), f"the hook's settings {subs[0].quant} are not the run's"
            marker = subs[0].marker
            assert marker is not None and all(c.marker is marker for c in subs)
            return refs, subs, marker
        marker = PassMarker()
        if cfg.bits is not None:  # the hook's arguments: causalkv's settings for the request
            quant = bridge_args(quant, env)
        subs = [
            SGLangQVGKVCache(
                batch_size=B, cache_size=cfg.cache_size, num_heads=cfg.heads, head_dim=D,
                dtype=DT, device=torch.device("cpu"),
                global_end_index=torch.zeros(1, dtype=torch.long),
                local_end_index=torch.zeros(1, dtype=torch.long),
                use_int_indices=cfg.int_indices, sink_tokens=cfg.sink,
                attention_window_size=kw["attention_window_size"], quant_args=quant,
                global_sink_tokens=cfg.global_sink, allow_growth=cfg.growth, marker=marker,
            )
            for _ in range(cfg.layers)
        ]
        return refs, subs, marker

    def global_end(self, ref) -> int:
        return int(ref.global_end_index.item())

    def extra_state(self, c) -> tuple:
        return (int(c.global_end_index.item()), int(c.local_end_index.item()),
                c.global_end_index_int, c.local_end_index_int, c.cache_size,
                c.attention_window_size, c.pinned_start, c.pinned_len)

    #: sglang's reset keeps its buffers: a write that skips positions then shows the previous
    #: request's K/V in the skipped slots, where the bridge (which frees them) shows zeros
    skip_after_reset = False
    def after_refusal(self, ref, trial) -> None:
        # sglang caches its int cursors on every call, refused or not (its buffer roll before a
        # refused write is not copied: the bridge plans, then commits)
        ref.global_end_index_int = trial.global_end_index_int
        ref.local_end_index_int = trial.local_end_index_int

    def allowed_extra(self, exc: BaseException) -> bool:
        # the bridge's documented refusal: a write sglang would serve by leaving two versions
        # of a position in its slots
        return isinstance(exc, CacheWriteError) and "two versions" in str(exc)

    def __init__(self) -> None:
        self.packed = PackedKinds()

    def check_view(self, cfg: Config, got, want, q: torch.Tensor, where: str, sub) -> None:
        assert cursors(got) == cursors(want), f"{where}: cursors {cursors(got)} != {cursors(want)}"
        STATS.saw(self.packed.of(sub.store))  # (sglang's views carry no positions)
        assert_values(cfg.quant, got.k, want.k, f"{where}: view.k")
        assert_values(cfg.quant, got.v, want.v, f"{where}: view.v")


STATS = Stats()
Machine = make_machine(SGLangEnv(), STATS)
TestBridgeStateMachine = Machine.TestCase
TestBridgeStateMachine.settings = machine_settings(EXAMPLES, STEPS)


def test_examples_ran():
    """Runs after the machine (file order): the runs covered what they are meant to: every
    codec and recency tiers (re-packed or not) drawn, and (the derandomized run) views of
    caches holding each of them packed."""
    if STATS.runs == 0:  # the machine test was deselected
        return
    assert STATS.runs >= EXAMPLES
    assert STATS.probes > 0 and STATS.commits > 0 and STATS.unmarked > 0 and STATS.refused_both > 0
    print(f"bridge state machine: {STATS}")
    if EXAMPLES < 500:  # a shorter run (CAUSALKV_MACHINE_EXAMPLES) need not cover every kind
        return
    drawn = {f"codec={c}" for c in ("off", *CODECS)} | {f"tier={c}" for c in CODECS} | {
        "tier=codec", "tier re-packed"}
    assert drawn <= set(STATS.kinds), f"never drawn: {sorted(drawn - set(STATS.kinds))}"
    if not DERANDOMIZE:  # new examples cluster (a few configs, many op sequences): the
        return  # counts above say what their views showed; `make test`'s run must show all
    shown = {f"packed {c}" for c in CODECS} | {"re-packed from the tier"} | {
        f"packed {c} at the tier" for c in CODECS}
    assert shown <= set(STATS.viewed), f"no view showed: {sorted(shown - set(STATS.viewed))}"
