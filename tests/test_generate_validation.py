"""Bad input is refused by `plan_generation` before any weights load, with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import make_options

from causalkv.capabilities import PINNED_SINK, RECENT_WINDOW
from causalkv.config import ServerArgs
from causalkv.runtime.host.plan_step import plan_generation
from causalkv.runtime.model_io.preset_configs import preset_dir
from causalkv.stages.base import CausalDenoisingStage
from causalkv.stages.families import SCENE_CUT_PREFIX
from causalkv.stages.longlive2 import LongLive2Stage


@pytest.fixture
def causalkv_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An empty CAUSALKV_HOME per test: a refused request must leave it empty."""
    monkeypatch.setenv("CAUSALKV_HOME", str(tmp_path))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        ("tiny-wan", {"frames": 10}, r"frames=10 is not divisible by frames per chunk=3 of tiny-wan; pass --frames 9 or 12"),
        ("tiny-wan", {"frames": 0}, r"frames must be a positive int, got 0"),
        ("tiny-wna", {}, r"unknown model 'tiny-wna': not a preset \(choose one of: tiny-wan"),
        ("tiny-wan", {"prompts": []}, r"the prompt list is empty; pass at least one --prompt"),
        ("tiny-wan", {"prompts": ["  "]}, r"prompts must be non-empty text, got '  '"),
        ("tiny-longlive", {"sink_frames": -1}, r"--sink-frames must be an int >= 0, got -1"),
        ("tiny-wan", {"window_frames": 2}, r"window of 2 frames is smaller than a chunk of 3 frames; pass --window-frames >= 3"),
        ("tiny-longlive", {"window_frames": 5}, r"cannot hold the sink \(3\) plus a chunk of 3 frames; pass --window-frames >= 6"),
        ("tiny-lingbot", {"recent_window_frames": -3}, r"--recent-window-frames must be an int >= 0, got -3"),
        ("tiny-wan", {"prompts": ["a", "b", "c", "d", "e"], "frames": 12}, r"5 prompts need at least 5 chunks, the request has 4"),
    ],
)
def test_bad_input_is_refused_before_any_weights_load(
    causalkv_home: str, pm, model: str, kwargs: dict, message: str
) -> None:
    prompts = kwargs.pop("prompts", None)
    with pytest.raises(ValueError, match=message):  # settings records refuse bad values at once
        options = make_options(model, frames=kwargs.pop("frames", None), **kwargs)
        if prompts is not None:
            options.prompts = prompts
        plan_generation(options, pm=pm)
    assert not preset_dir(model).exists(), "no preset may be materialized for a refused request"


def test_folder_missing_files_is_refused(causalkv_home: str, pm, tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    with pytest.raises(ValueError, match=r"is missing transformer/config.json, vae/config.json, "
                       r"text_encoder/config.json, tokenizer"):
        plan_generation(make_options(str(tmp_path)), pm=pm)


def test_multi_shot_window_must_hold_both_sinks(causalkv_home: str, pm) -> None:
    # tiny-longlive2: global sink 2 + shot sink 2 + chunk 2 = 6 frames > window 5
    options = make_options("tiny-longlive2", prompts=["a", "b"], window_frames=5)
    with pytest.raises(ValueError, match=r"global sink \(2\) plus a pinned shot sink \(2\) plus a chunk"):
        plan_generation(options, pm=pm)


def test_multi_shot_is_automatic_for_longlive2(causalkv_home: str, pm) -> None:
    plan = plan_generation(make_options("tiny-longlive2", prompts=["a forest", "a city"], frames=8), pm=pm)
    assert plan.server_args.multi_shot
    assert PINNED_SINK in plan.resolution.requirements
    assert plan.chunk_prompts == ["a forest", "a forest", SCENE_CUT_PREFIX + "a city", "a city"]
    assert plan.server_args.guidance_scale == 3.0  # the preset's default
    # one prompt: no multi-shot, no pinned-sink requirement
    single = plan_generation(make_options("tiny-longlive2", frames=8), pm=pm)
    assert not single.server_args.multi_shot and PINNED_SINK not in single.resolution.requirements
    # other stages: several prompts are prompt switches, not scene cuts
    wan = plan_generation(make_options("tiny-wan", prompts=["a", "b"], frames=6), pm=pm)
    assert not wan.server_args.multi_shot and wan.chunk_prompts == ["a", "b"]


def test_lingbot_requires_recent_window(causalkv_home: str, pm) -> None:
    plan = plan_generation(make_options("tiny-lingbot"), pm=pm)
    assert RECENT_WINDOW in plan.resolution.requirements
    assert plan.settings.recent_window_frames == 3


def test_plan_chunks_spreads_prompts_evenly() -> None:
    assert CausalDenoisingStage.plan_chunks(["a", "b"], 5, ServerArgs()) == ["a", "a", "a", "b", "b"]
    shots = ServerArgs(multi_shot=True)
    assert LongLive2Stage.plan_chunks(["a", "b", "c"], 3, shots) == ["a", SCENE_CUT_PREFIX + "b", SCENE_CUT_PREFIX + "c"]
    # the seed runtime prefixes every cut, even a prompt that already carries the prefix
    assert LongLive2Stage.plan_chunks(["a", SCENE_CUT_PREFIX + "b"], 2, shots)[1] == 2 * SCENE_CUT_PREFIX + "b"
