"""The seed runtime's request model, without weights: LongLive 2.0 shot expansion, its UniPC
sampler, fractional RoPE starts, LingBot-World's moving/still window rule, the CLI flags."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch

from causalkv.cli.generate import add_generate_args, options_from_args
from causalkv.config import ModelConfig, ServerArgs
from causalkv.errors import ConfigError
from causalkv.runtime import resolve
from causalkv.stages.families import SCENE_CUT_PREFIX as P
from causalkv.stages.families import MotionOptions, ShotRequest, parse_motion
from causalkv.stages.lingbot import LingBotWorldStage, window_per_chunk
from causalkv.stages.longlive2 import (
    LongLive2Stage,
    ShotPlan,
    expand_shots,
    layout_of,
    unipc_sigmas,
)


def _shots(durations_taken: list[int], prompts: str = "abc", prefix: str = P) -> tuple:
    """The expected layout from the chunks each shot takes (written from the rules)."""
    chunks, cuts, idx = [], [], []
    for k, n in enumerate(durations_taken):
        for c in range(n):
            chunks.append(prefix + prompts[k] if k > 0 and c == 0 else prompts[k])
            cuts.append(k > 0 and c == 0)
            idx.append(k)
    return tuple(chunks), tuple(cuts), tuple(idx)


# (shot prompts, chunks, durations, chunks_per_shot, chunks each shot takes)
EXPANSION_CASES = [
    pytest.param("abc", 6, None, 0, [2, 2, 2], id="even-split"),
    pytest.param("abc", 7, None, 0, [3, 2, 2], id="even-split-first-one-longer"),
    pytest.param("abc", 8, None, 0, [3, 3, 2], id="even-split-first-two-longer"),
    pytest.param("abc", 2, None, 0, [1, 1], id="fewer-chunks-than-shots-drops-the-last"),
    pytest.param("abc", 6, [2, 1, 3], 0, [2, 1, 3], id="durations"),
    pytest.param("ab", 4, [3, 2], 0, [3, 1], id="durations-clamped-to-the-chunks"),
    pytest.param("ab", 5, [1, 1], 0, [1, 4], id="remainder-to-the-last-shot"),
    pytest.param("abc", 4, [2, 5, 1], 0, [2, 2], id="clamped-shot-ends-the-video"),
    pytest.param("abc", 8, None, 2, [2, 2, 4], id="chunks-per-shot-remainder-to-last"),
    pytest.param("abc", 5, None, 3, [3, 2], id="chunks-per-shot-clamped"),
    pytest.param("ab", 3, [1, 2], 5, [1, 2], id="durations-win-over-chunks-per-shot"),
    pytest.param("a", 3, None, 0, [3], id="one-shot-no-cut"),
]


@pytest.mark.parametrize(("prompts", "chunks", "durations", "cps", "taken"), EXPANSION_CASES)
def test_expand_shots_follows_the_seed_rules(prompts, chunks, durations, cps, taken) -> None:
    layout = expand_shots(list(prompts), chunks, durations=durations, chunks_per_shot=cps)
    assert sum(taken) == chunks
    assert (layout.chunk_prompts, layout.scene_cuts, layout.shot_indices) == _shots(taken, prompts)


def test_empty_prefix_cuts_without_changing_the_prompt() -> None:
    layout = expand_shots(["a", "b"], 4, scene_cut_prefix="")
    assert layout.chunk_prompts == ("a", "a", "b", "b")
    assert layout.scene_cuts == (False, False, True, False)
    # the same prompt twice is still two shots (the mask, not the text, marks the cut)
    same = expand_shots(["a", "a"], 2, scene_cut_prefix="")
    assert same.scene_cuts == (False, True) and same.shot_indices == (0, 1)


def test_prefix_is_added_even_when_the_prompt_has_it() -> None:
    assert expand_shots(["a", P + "b"], 2).chunk_prompts == ("a", P + P + "b")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shot_prompts": []}, "prompt list is empty"),
        ({"shot_prompts": ["a", ""]}, "prompts must be non-empty text"),
        ({"durations": [1]}, r"must match the shot prompts: 1 durations \[1\] for 2 shots"),
        ({"durations": [2, 0]}, r"shot durations must be positive chunk counts, got 0 in \[2, 0\]"),
        ({"durations": [2, -1]}, "shot durations must be positive chunk counts, got -1"),
        ({"durations": [2, True]}, "shot durations must be positive chunk counts, got True"),
        ({"durations": []}, "shot durations must be a non-empty list of chunk counts, got \\[\\]"),
        ({"chunks_per_shot": -1}, "--chunks-per-shot must be an int >= 0, got -1"),
        ({"num_chunks": 0}, "chunks must be a positive int, got 0"),
    ],
)
def test_expand_shots_refuses_bad_requests(kwargs, message) -> None:
    args = {"shot_prompts": ["a", "b"], "num_chunks": 4, **kwargs}
    with pytest.raises(ConfigError, match=message):
        expand_shots(args.pop("shot_prompts"), args.pop("num_chunks"), **args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"durations": (3, 0)}, "shot durations must be positive chunk counts, got 0"),
        ({"durations": ()}, "non-empty list of chunk counts"),
        ({"chunks_per_shot": -2}, "--chunks-per-shot must be an int >= 0"),
        ({"multi_shot_rope_offset": -0.5}, r"RoPE offset must be a finite number >= 0, got -0.5"),
        ({"multi_shot_rope_offset": math.nan}, "RoPE offset must be a finite number"),
        ({"scene_cut_prefix": None}, "scene cut prefix must be text"),
    ],
)
def test_shot_request_validates_on_construction(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ShotRequest(**kwargs)


def test_plan_chunks_carries_the_layout_and_refuses_foreign_fields() -> None:
    args = ServerArgs(options=[ShotRequest(durations=(2, 1, 3))])
    plan = LongLive2Stage.plan_chunks(["a", "b", "c"], 6, args)
    assert isinstance(plan, ShotPlan) and isinstance(plan, list)
    assert plan == ["a", "a", P + "b", P + "c", "c", "c"]
    assert plan.layout.scene_cuts == (False, False, True, True, False, False)
    assert layout_of(plan, args) is plan.layout
    # a plain list: cuts where the prompt carries the prefix
    assert layout_of(list(plan), args).shot_indices == (0, 0, 1, 2, 2, 2)
    # another family's knobs: the one refusal is the resolution's (foreign_options_error)
    with pytest.raises(ConfigError, match="--motion applies to LingBot-World"):
        resolve("tiny-longlive2", ServerArgs(options=[MotionOptions(motion=("m", "s"))]))
    with pytest.raises(ConfigError, match=r"shot flags \(--shot-durations.*\) apply to multi-shot "
                       "stages, not to LingBotWorldStage .stage 'lingbot-world'.; they are options "
                       "of stage 'longlive2'; drop them or pick a LongLive 2.0 model"):
        resolve("tiny-lingbot", args)


# ---- the sampler ----------------------------------------------------------------------------


def _seed_sigmas(steps: int, shift: float) -> list[float]:
    """The seed runtime's schedule from its formula: sigma_max = float32(1 - 1/1000) (the
    top of the 1000-step, shift-1 training schedule), ``steps`` evenly spaced sigmas from it
    down to 0 (0 excluded), shifted as ``shift * s / (1 + (shift - 1) * s)``."""
    smax = float(np.float32(1.0 - 1.0 / 1000.0))
    base = [smax - k * smax / steps for k in range(steps)]
    return [shift * s / (1.0 + (shift - 1.0) * s) for s in base]


@pytest.mark.parametrize(("steps", "shift"), [(4, 5.0), (6, 1.0), (3, 3.0)])
def test_unipc_timesteps_and_sigmas_match_the_seed_configuration(steps: int, shift: float) -> None:
    sched = LongLive2Stage.scheduler_spec(ModelConfig("m", "LongLive2Pipeline", 1, 1, 8, 1, 1, shift=shift)).build()
    cfg = sched.config
    assert (cfg.num_train_timesteps, cfg.prediction_type, cfg.use_flow_sigmas, cfg.flow_shift) == (
        1000, "flow_prediction", True, shift)
    assert (cfg.solver_order, cfg.solver_type, cfg.predict_x0, cfg.final_sigmas_type) == (2, "bh2", True, "zero")
    assert not cfg.use_dynamic_shifting
    sched.set_timesteps(sigmas=unipc_sigmas(steps))
    expected = _seed_sigmas(steps, shift)
    assert sched.timesteps.dtype == torch.int64
    assert sched.timesteps.tolist() == [int(s * 1000) for s in expected]
    assert sched.sigmas.tolist() == pytest.approx([*expected, 0.0], abs=1e-7)


def test_tiny_longlive2_schedule_is_four_shift_five_steps() -> None:
    # 4 steps, shift 5: 999.8, 937.4, 833.2, 624.8 -> int64
    assert [int(s * 1000) for s in _seed_sigmas(4, 5.0)] == [999, 937, 833, 624]


def test_unipc_recovers_x0_from_an_exact_flow() -> None:
    """With the exact flow of one data point (x_s = (1 - s) x0 + s eps, v = eps - x0), the
    flow-prediction UniPC lands on x0: a sampler configured for another parameterization
    would not."""
    sched = LongLive2Stage.scheduler_spec(ModelConfig("m", "LongLive2Pipeline", 1, 1, 8, 1, 1)).build()
    sched.set_timesteps(sigmas=unipc_sigmas(4))
    sched.set_begin_index(0)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 4, 2, 4, 4, generator=g, dtype=torch.float64)
    eps = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    s0 = float(sched.sigmas[0])
    x = (1 - s0) * x0 + s0 * eps
    for t in sched.timesteps:
        x = sched.step(eps - x0, t, x, return_dict=False)[0]
    assert torch.allclose(x, x0, atol=1e-6)


# ---- fractional RoPE starts -------------------------------------------------------------------


def _rope():
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    return WanRotaryPosEmbed(attention_head_dim=64, patch_size=(1, 2, 2), max_seq_len=64)


def test_fractional_rope_start_is_a_continuous_position() -> None:
    from causalkv.runtime.model_io.causal_wan import rope_at_frame_offset

    rope = _rope()
    f, h, w = 2, 4, 4
    cos, sin = rope_at_frame_offset(rope, f, h, w, 2.5)
    t_dim, hw = rope.t_dim, (h // 2) * (w // 2)
    # float64 oracle: theta 10000, frequency 10000 ** (-2i / t_dim), each repeated twice
    freqs = [10000.0 ** (-(2 * i) / t_dim) for i in range(t_dim // 2)]
    for k in range(f):
        pos = 2.5 + k
        want_cos = torch.tensor([math.cos(pos * fr) for fr in freqs for _ in range(2)], dtype=torch.float64)
        want_sin = torch.tensor([math.sin(pos * fr) for fr in freqs for _ in range(2)], dtype=torch.float64)
        rows = slice(k * hw, (k + 1) * hw)
        assert torch.allclose(cos[0, rows, 0, :t_dim].double(), want_cos.expand(hw, -1), atol=1e-7)
        assert torch.allclose(sin[0, rows, 0, :t_dim].double(), want_sin.expand(hw, -1), atol=1e-7)
    # the spatial parts are those of the integer path
    ref_cos, _ = rope_at_frame_offset(rope, f, h, w, 2)
    assert torch.equal(cos[..., t_dim:], ref_cos[..., t_dim:])


def test_integer_rope_start_reads_the_tables() -> None:
    from causalkv.runtime.model_io.causal_wan import rope_at_frame_offset, rope_temporal_at

    rope = _rope()
    cos, sin = rope_at_frame_offset(rope, 2, 4, 4, 3)
    full_cos, full_sin = rope(torch.zeros(1, 4, 5, 4, 4))  # rows of a 5-frame video
    assert torch.equal(cos, full_cos[:, 3 * 4 :]) and torch.equal(sin, full_sin[:, 3 * 4 :])
    assert torch.equal(rope_at_frame_offset(rope, 2, 4, 4, 3.0)[0], cos)  # 3.0 is the integer path
    # the continuous formula agrees with the tables at integer positions (float32 tables)
    c, s = rope_temporal_at(rope, torch.tensor([3.0, 4.0], dtype=torch.float64))
    assert torch.allclose(c.float(), rope.freqs_cos[3:5, : rope.t_dim], atol=1e-7)
    assert torch.allclose(s.float(), rope.freqs_sin[3:5, : rope.t_dim], atol=1e-7)


# ---- LingBot-World's window rule -----------------------------------------------------------


@pytest.mark.parametrize(
    ("motion", "n", "modes"),
    [
        ("m,s,s,s,m,s", 2, "mmssmm"),  # still at chunks 2 and 3
        ("m,s,s,s,m,s", 1, "msssms"),
        ("m,s,s,s,m,s", 3, "mmmsmm"),
        ("s,s,m,s,s", 2, "msmms"),  # chunk 0 starts from a zero count
        ("m,m,m", 2, "mmm"),
    ],
)
def test_window_rule(motion: str, n: int, modes: str) -> None:
    got = window_per_chunk(parse_motion(motion), moving_frames=6, still_frames=3, still_chunks=n)
    assert got == [
        {"mode": "moving" if m == "m" else "still", "frames": 6 if m == "m" else 3} for m in modes
    ]


def test_window_rule_without_a_still_window_stays_moving() -> None:
    got = window_per_chunk(("s", "s", "s"), moving_frames=6, still_frames=None)
    assert got == [{"mode": "moving", "frames": 6}] * 3


def test_motion_is_validated() -> None:
    assert MotionOptions(motion="m, s,S").motion == ("m", "s", "s")
    with pytest.raises(ConfigError, match="one letter per chunk, m .* or s"):
        MotionOptions(motion="m,x")
    with pytest.raises(ConfigError, match="--motion has 3 letters for 4 chunks"):
        LingBotWorldStage.plan_chunks(["a"], 4, ServerArgs(options=[MotionOptions(motion="m,s,s")]))


# ---- CLI ------------------------------------------------------------------------------------


def _options(*argv: str):
    parser = add_generate_args(argparse.ArgumentParser())
    return options_from_args(parser.parse_args(list(argv)))


def test_shot_flags_build_the_request() -> None:
    o = _options("--shot-prompt", "a", "--shot-prompt", "b", "--shot-durations", "3,2",
                 "--scene-cut-prefix", "", "--no-multi-shot-sink", "--multi-shot-rope-offset", "1.5",
                 "--chunks-per-shot", "2")
    assert list(o.prompts) == ["a", "b"]
    assert o.server_args.option(ShotRequest) == ShotRequest(
        durations=(3, 2), chunks_per_shot=2, scene_cut_prefix="", multi_shot_sink=False,
        multi_shot_rope_offset=1.5)
    assert not _options("--prompt", "a", "--prompt", "b").server_args.option(ShotRequest).changed()
    assert _options("--motion", "m,s").server_args.option(MotionOptions).motion == ("m", "s")
    with pytest.raises(ConfigError, match="with --prompt or with --shot-prompt, not both"):
        _options("--prompt", "a", "--shot-prompt", "b")
    with pytest.raises(ConfigError, match="comma-separated chunk counts"):
        _options("--shot-durations", "3,x")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "a", "--shot-prompt", "b"], "with --prompt or with --shot-prompt, not both"),
        (["--model", "tiny-lingbot", "--motion", "m,s,s"], "--motion has 3 letters for 4 chunks"),
        (["--model", "tiny-lingbot", "--motion", "m,q,s,s"], "one letter per chunk"),
        (["--model", "tiny-longlive2", "--shot-prompt", "a", "--shot-prompt", "b",
          "--shot-durations", "1"], "1 durations [1] for 2 shots"),
        (["--model", "tiny-longlive2", "--shot-prompt", "a", "--shot-durations", "0"],
         "shot durations must be positive chunk counts, got 0"),
        (["--model", "tiny-longlive2", "--multi-shot-rope-offset", "-1"], "RoPE offset must be a finite number >= 0"),
        (["--model", "tiny-wan", "--shot-durations", "2,2", "--prompt", "a", "--prompt", "b"],
         "shot flags"),
        (["--model", "tiny-wan", "--motion", "m,m,m,m"], "--motion applies to LingBot-World"),
    ],
)
def test_bad_request_flags_exit_2(
    causalkv_home: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    from causalkv.cli import main

    rc = main(["generate", "--quiet", "--no-video", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.count("\n") == 1
