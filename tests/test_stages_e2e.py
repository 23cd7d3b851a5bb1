"""End to end on the tiny presets: every built-in stage x quant off/int2, LongLive 2.0
multi-shot with scene cuts, LongLive re-caching, LingBot recent windows, determinism and
dense / QVG-off equivalence. A request several tests read runs once (`shared`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from runtime_helpers import make_options, plan_and_run

from causalkv.caches.dense import DenseCausalKVCache
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.hooks import hookimpl
from causalkv.plugin.testing import temporary_plugin
from causalkv.runtime.host.pipeline_records import GenerationRun, Plan
from causalkv.runtime.host.plan_step import plan_generation
from causalkv.runtime.host.run_step import run_plan
from causalkv.stages import LingBotWorldStage, LongLive2Stage, LongLiveStage, WanCausalDMDStage

STAGES = {
    "tiny-wan": WanCausalDMDStage,
    "tiny-longlive": LongLiveStage,
    "tiny-longlive2": LongLive2Stage,
    "tiny-lingbot": LingBotWorldStage,
}


@pytest.fixture(scope="module")
def shared(causalkv_home: str) -> Callable[..., tuple[Plan, GenerationRun]]:
    """``shared(pm, preset, **make_options_kwargs)``: `plan_and_run` of that request, run once
    for this module (the tests only read a run; the same request gives the same run)."""
    runs: dict[tuple, tuple[Plan, GenerationRun]] = {}

    def run(pm, preset: str, **kw) -> tuple[Plan, GenerationRun]:
        # make_options' defaults filled in: one key per request however it is spelled
        given = {"quant": "off", "seed": 0, **{k: v for k, v in kw.items() if v is not None}}
        key = (preset, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in given.items())))
        if key not in runs:
            runs[key] = plan_and_run(make_options(preset, **kw), pm)
        return runs[key]

    return run


@pytest.mark.parametrize("quant", ["off", "int2"])
@pytest.mark.parametrize("preset", list(STAGES))
def test_every_stage_generates_with_and_without_qvg(shared, pm, preset: str, quant: str) -> None:
    plan, run = shared(pm, preset, quant=quant)
    stage = run.stage
    assert type(stage) is STAGES[preset]
    cache_cls = DenseCausalKVCache if quant == "off" else QVGPackedCausalKVCache
    assert plan.resolution.cache_factory.name == ("dense" if quant == "off" else "qvg")
    assert all(type(c) is cache_cls for c in stage.caches.kv)
    info = plan.info
    assert run.latents.shape == (1, 4, info.default_frames, 8, 8)
    assert torch.isfinite(run.latents).all()
    tpc = plan.settings.tokens_per_chunk
    assert [s["token_start"] for s in run.chunk_stats] == [i * tpc for i in range(plan.num_chunks)]
    assert stage.caches.kv[0].global_end == plan.num_chunks * tpc
    if quant == "int2":
        assert all(c.quant.bits == 2 for c in stage.caches.kv)


def test_int2_holds_less_kv_than_dense(shared, pm) -> None:
    # tiny-wan, 4 chunks, window 3 chunks: with keep_recent_chunks=1 the oldest retained chunk is packed
    _, dense = shared(pm, "tiny-wan", quant="off")
    _, packed = shared(pm, "tiny-wan", quant="int2")
    # dense preallocates K+V for the whole cache: layers x 2 x 144 tokens x 2 heads x 64 x 4 bytes
    assert dense.kv_resident_bytes_max == 2 * 2 * 144 * 2 * 64 * 4
    assert packed.kv_resident_bytes_final < dense.kv_resident_bytes_final
    assert not torch.equal(packed.latents, dense.latents)


def test_longlive2_multi_shot_pins_scene_cuts_with_int2(causalkv_home: str, pm) -> None:
    # 16 frames = 8 chunks of 2 frames (32 tokens); shot B starts at chunk 4 = tokens [128, 160)
    options = make_options("tiny-longlive2", prompts=["a forest", "a city"], frames=16, quant="int2")
    plan, run = plan_and_run(options, pm)
    stage = run.stage
    assert plan.server_args.multi_shot and stage.pinned_chunks == [4]
    assert len(stage.cache_sets()) == 2  # CFG 3.0: its own negative cache
    assert all(type(c) is QVGPackedCausalKVCache for c in stage.cache_sets()[1].kv)
    # RoPE: shot 1 is offset by 2 frames
    assert [s["rope_frame_start"] for s in run.chunk_stats] == [0, 2, 4, 6, 10, 12, 14, 16]
    # window 8 frames = 128 tokens. The last commit kept what the next chunk [256, 288) reads:
    # the global sink [0, 32), the pinned shot sink [128, 160) and the newest 128 - 64 = 64
    # other tokens [224, 288), so [224, 256) of what exists; without the pin the next chunk
    # would read [0, 32) + [192, 288).
    for cs in stage.cache_sets():
        for cache in cs.kv:
            assert cache.visible_positions() == ((0, 32), (128, 160), (224, 256))
    assert torch.isfinite(run.latents).all()


def test_longlive2_pinned_shot_sink_survives_eviction(causalkv_home: str, pm) -> None:
    # 16 frames = 8 chunks of 32 tokens; shot B opens at chunk 4 = tokens [128, 160); at the
    # end (global_end 256) chunk 5, the first ordinary chunk after the cut, has rolled out,
    # and the shot sink, older than it, is still pinned
    options = make_options("tiny-longlive2", prompts=["a forest", "a city"], frames=16)
    _, run = plan_and_run(options, pm)
    # window 8 frames = 128 tokens: 32 global + 32 pinned + newest 64 ordinary tokens
    assert run.stage.caches.kv[0].visible_positions() == ((0, 32), (128, 160), (192, 256))


def test_quant_off_on_the_qvg_cache_equals_the_dense_cache(shared, pm) -> None:
    # tiny-wan's default 12 frames (4 chunks) and tiny-longlive2 at 12 frames, two shots
    for preset, prompts, frames in (("tiny-wan", None, None), ("tiny-longlive2", ["a", "b"], 12)):
        _, dense = shared(pm, preset, prompts=prompts, frames=frames, quant="off")
        _, qvg = plan_and_run(make_options(preset, prompts=prompts, frames=frames, cache="qvg"), pm)
        assert all(type(c) is QVGPackedCausalKVCache for c in qvg.stage.caches.kv)
        assert torch.equal(dense.latents, qvg.latents), preset


def test_same_seed_same_latents_other_seed_differs(shared, pm) -> None:
    _, a = shared(pm, "tiny-lingbot", quant="int2")  # seed 0, run by another test too
    _, b = plan_and_run(make_options("tiny-lingbot", quant="int2", seed=0), pm)
    _, c = plan_and_run(make_options("tiny-lingbot", quant="int2", seed=8), pm)
    assert torch.equal(a.latents, b.latents)
    assert not torch.allclose(a.latents, c.latents)


def test_bfloat16_default_dtype_runs(causalkv_home: str, pm) -> None:
    plan, run = plan_and_run(make_options("tiny-wan", frames=6, dtype="bfloat16", quant="int2"), pm)
    assert run.stage.caches.kv[0].spec.dtype == torch.bfloat16
    assert torch.isfinite(run.latents).all() and run.latents.dtype == torch.float32


def test_longlive_prompt_switch_recaches_the_visible_frames(causalkv_home: str, pm) -> None:
    # 15 frames = 5 chunks of 48 tokens, prompts split 2/2/1: switches at chunks 2 and 4.
    # Sink 3 frames (1 chunk), window 9 frames (3 chunks). At the switch before chunk 4 the
    # caches show chunk 0 (sink) and chunks 2-3: 3 chunks = 144 tokens are re-cached, so
    # chunk 4 starts at cache position 144 (not 192), still at RoPE frame 12.
    options = make_options("tiny-longlive", prompts=["a", "b", "c"], frames=15)
    _, run = plan_and_run(options, pm)
    stage = run.stage
    assert stage.recache_events == [2, 4]
    assert [s["token_start"] for s in run.chunk_stats] == [0, 48, 96, 144, 144]
    assert [s["rope_frame_start"] for s in run.chunk_stats] == [0, 3, 6, 9, 12]
    assert [f for f, _ in stage.loop.cache_frames] == [0, 1, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert stage.caches.kv[0].global_end == 144 + 48


def test_lingbot_recent_window_limits_what_a_chunk_sees(shared, pm) -> None:
    # sink 48 tokens, window 192, recent window 3 frames = 48 tokens before the chunk:
    # chunk k sees [0, 48) + [max(48, 48k - 48), 48k + 48)
    _, run = shared(pm, "tiny-lingbot", quant="off")
    assert [s["visible_tokens"] for s in run.chunk_stats] == [48, 96, 144, 144]
    _, wide = plan_and_run(make_options("tiny-lingbot", recent_window_frames=6), pm)
    assert [s["visible_tokens"] for s in wide.chunk_stats] == [48, 96, 144, 192]
    assert not torch.equal(run.latents[:, :, 9:], wide.latents[:, :, 9:])
    assert torch.equal(run.latents[:, :, :9], wide.latents[:, :, :9])


def test_plugin_hooks_configure_the_stage_and_see_every_chunk(causalkv_home: str, pm) -> None:
    seen: list[tuple[str, int, int]] = []

    class Plugin:
        @hookimpl
        def causalkv_configure_stage(self, stage, model, server_args):
            return {"window_frames": 6}

        @hookimpl
        def causalkv_chunk_done(self, stage, chunk_index, stats):
            seen.append((stage.name, chunk_index, stats["visible_tokens"]))

    with temporary_plugin(pm, Plugin()):
        _, run = plan_and_run(make_options("tiny-wan"), pm)
    assert run.stage.settings.window_frames == 6
    # window 6 frames = 96 tokens: every chunk from the second on sees 2 chunks
    assert seen == [("self-forcing-wan", 0, 48), ("self-forcing-wan", 1, 96),
                    ("self-forcing-wan", 2, 96), ("self-forcing-wan", 3, 96)]


def test_attribute_and_override_plugins_both_apply_to_one_stage(causalkv_home: str, pm) -> None:
    """One plugin sets an attribute, another returns overrides: both take effect on the one
    stage the host builds, whose caches are allocated once, with the overridden window."""
    built: list[object] = []
    factory_builds: list[int] = []

    class SetsAttribute:
        @hookimpl
        def causalkv_configure_stage(self, stage):
            built.append(stage)
            stage.negative_prompt = "set by a plugin"

    class ReturnsOverrides:
        @hookimpl
        def causalkv_configure_stage(self, stage):
            built.append(stage)
            return {"window_frames": 6}

    plan = plan_generation(make_options("tiny-wan"), pm=pm)
    real = plan.resolution.cache_factory

    class CountingFactory:
        name = real.name

        def build(self, spec, quant=None):
            factory_builds.append(spec.attention_window_size)
            return real.build(spec, quant)

    with temporary_plugin(pm, SetsAttribute()), temporary_plugin(pm, ReturnsOverrides()):
        run = run_plan(plan, pm=pm, resolution=replace(plan.resolution, cache_factory=CountingFactory()))
    stage = run.stage
    assert len(built) == 2 and all(s is stage for s in built)
    assert stage.negative_prompt == "set by a plugin"
    assert stage.settings.window_frames == 6
    tpf = plan.settings.tokens_per_frame
    assert factory_builds == [6 * tpf] * plan.model.num_layers  # one cache per layer, once
    assert [st["visible_tokens"] for st in run.chunk_stats] == [48, 96, 96, 96]


def test_overrides_after_the_caches_exist_are_refused(shared, pm) -> None:
    _, run = shared(pm, "tiny-wan", quant="off")
    with pytest.raises(RuntimeError, match="already allocated"):
        run.stage.apply_overrides({"window_frames": 6})
    assert run.stage.settings.window_frames == 9
