"""End to end on the tiny presets: LongLive 2.0 shots (pins on the cut chunks, per-shot RoPE
starts, fractional offsets, sinks off) and LingBot-World's motion-driven KV window on both
caches, quantization on and off."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from runtime_helpers import make_options, plan_and_run

from causalkv.caches.dense import DenseCausalKVCache
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.capabilities import PINNED_SINK
from causalkv.hooks import hookimpl
from causalkv.plugin.testing import temporary_plugin
from causalkv.runtime.host.plan_step import plan_generation
from causalkv.runtime.host.report import run_report
from causalkv.stages.families import MotionOptions, ShotRequest


def test_longlive2_three_shots_pin_exactly_the_cut_chunks_with_int2(causalkv_home: str, pm) -> None:
    # 12 frames = 6 chunks of 2 frames (32 tokens); shots of 2, 1, 3 chunks: cuts at chunks 2, 3
    options = make_options("tiny-longlive2", prompts=["a forest", "a city", "a beach"], frames=12,
                           quant="int2", options=[ShotRequest(durations=(2, 1, 3))])
    plan, run = plan_and_run(options, pm)
    stage = run.stage
    assert plan.server_args.multi_shot and PINNED_SINK in plan.resolution.requirements
    assert plan.chunk_prompts.layout.shot_indices == (0, 0, 1, 2, 2, 2)
    assert stage.pinned_chunks == [2, 3]
    assert all(type(c) is QVGPackedCausalKVCache for cs in stage.cache_sets() for c in cs.kv)
    assert len(stage.cache_sets()) == 2  # CFG 3.0: the negative branch pins too
    # RoPE start = 2 * chunk + 2 (the preset's offset) * shot
    assert [s["rope_frame_start"] for s in run.chunk_stats] == [0, 2, 6, 10, 12, 14]
    # window 8 frames = 128 tokens. The last commit kept what the next chunk [192, 224) reads:
    # the global sink [0, 32), the shot sinks the window keeps -- the last pin [96, 128) --
    # and the newest ordinary tokens 128 - 64 = 64 of [160, 224), so [160, 192) of what exists
    assert stage.caches.kv[0].visible_positions() == ((0, 32), (96, 128), (160, 192))
    m = run_report(plan, run)
    assert m["pinned_chunks"] == [2, 3] and m["scene_cut_chunks"] == [2, 3]
    assert m["rope_frame_start_per_chunk"] == [0, 2, 6, 10, 12, 14]
    assert m["chunk_prompts"][2].endswith("a city") and m["sampler_timesteps"] == [999, 937, 833, 624]
    assert torch.isfinite(run.latents).all()


def test_longlive2_fractional_offset_and_sinks_off(causalkv_home: str, pm) -> None:
    shots = ShotRequest(multi_shot_rope_offset=1.5, multi_shot_sink=False, scene_cut_prefix="")
    plan, run = plan_and_run(
        make_options("tiny-longlive2", prompts=["a forest", "a city"], frames=8, options=[shots]), pm
    )
    # sinks off: no multi-shot resolution, no pins; the cut still shifts RoPE by 1.5 frames
    assert not plan.server_args.multi_shot and PINNED_SINK not in plan.resolution.requirements
    assert list(plan.chunk_prompts) == ["a forest", "a forest", "a city", "a city"]
    assert run.stage.pinned_chunks == []
    assert [s["rope_frame_start"] for s in run.chunk_stats] == [0, 2, 5.5, 7.5]
    assert torch.isfinite(run.latents).all()
    # a zero sink never pins either
    zero = plan_generation(make_options("tiny-longlive2", prompts=["a", "b"], frames=8, sink_frames=0), pm=pm)
    assert not zero.server_args.multi_shot


class _WindowRecorder:
    """Wraps the stage's transformer to record the recent window of every call."""

    def __init__(self, inner: Any, calls: list[int | None]) -> None:
        self._inner, self._calls = inner, calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, *args: Any, recent_window_tokens: int | None = None, **kw: Any) -> torch.Tensor:
        self._calls.append(recent_window_tokens)
        return self._inner(*args, recent_window_tokens=recent_window_tokens, **kw)


MOTION = ("m", "s", "s", "s", "m", "s")
# the rule with N = 2: still (3 frames) at chunks 2 and 3, moving (6 frames) elsewhere
WINDOWS = [("moving", 6), ("moving", 6), ("still", 3), ("still", 3), ("moving", 6), ("moving", 6)]


@pytest.mark.parametrize(("cache", "quant"), [("dense", "off"), ("qvg", "off"), ("qvg", "int2")])
def test_lingbot_motion_switches_the_window_per_chunk(causalkv_home: str, pm, cache: str, quant: str) -> None:
    calls: list[int | None] = []

    class Record:
        @hookimpl
        def causalkv_configure_stage(self, stage):
            stage.denoiser = _WindowRecorder(stage.denoiser, calls)

    options = make_options("tiny-lingbot", frames=18, cache=cache, quant=quant,
                           options=[MotionOptions(motion=MOTION)])
    with temporary_plugin(pm, Record()):
        plan, run = plan_and_run(options, pm)
    cache_cls = DenseCausalKVCache if cache == "dense" else QVGPackedCausalKVCache
    assert all(type(c) is cache_cls for c in run.stage.caches.kv)
    report = run_report(plan, run)
    assert report["kv_window_per_chunk"] == [{"mode": m, "frames": f} for m, f in WINDOWS]
    # 16 tokens per frame; 4 denoising calls at the chunk's window, then the context pass
    # attends over the whole window (None)
    per_chunk = [[f * 16] * 4 + [None] for _, f in WINDOWS]
    assert calls == [c for chunk in per_chunk for c in chunk]
    # what a read shows after each chunk, with that chunk's window: sink 48 + the recent
    # frames that exist beyond it + the chunk's 48; a still window (3 frames) shows 144 tokens
    # from chunk 2 on, a moving one (6 frames) 192 from chunk 3 on. The packed cache's commit
    # (its stage marks the context pass) already dropped what chunk i + 1 drops: the cache
    # (4 chunks of 48) keeps the sink and the newest two chunks, 144 tokens at most
    want = [48, 96, 144, 144, 192, 192] if cache == "dense" else [48, 96, 144, 144, 144, 144]
    assert [s["visible_tokens"] for s in run.chunk_stats] == want
    assert torch.isfinite(run.latents).all()
