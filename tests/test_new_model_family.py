"""A whole new model family through one temporary plugin, touching no causalkv file.

The plugin brings a stage class, its registration (served pipeline class, config defaults)
and a tiny preset; the host then resolves, plans, materializes, loads and generates with it,
and the run report carries what the stage adds. This is the proof that a model family has one
home (its stage module / registration) and the runtime knows no model by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from runtime_helpers import make_options, plan_and_run

from causalkv.config import ServerArgs
from causalkv.hooks import Preset, StageRegistration
from causalkv.plugin.testing import RecordsPlugin, temporary_plugin
from causalkv.runtime import resolve
from causalkv.runtime.host.report import run_report
from causalkv.runtime.model_io.model_config import read_model_folder
from causalkv.runtime.model_io.preset_configs import preset_dir
from causalkv.stages.base import CausalDenoisingStage


class TinyWorldStage(CausalDenoisingStage):
    """A made-up family: QVG-capable, numbers its chunk prompts, reports its chunk count."""

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return True

    @classmethod
    def plan_chunks(cls, prompts, num_chunks, server_args: ServerArgs) -> list[str]:
        return [f"{p} (part {i})" for i, p in enumerate(super().plan_chunks(prompts, num_chunks, server_args))]

    def report(self) -> dict:
        return {"tiny_world_chunks": self.loop.token_end // self.settings.tokens_per_chunk}


REGISTRATION = StageRegistration(
    "tiny-world",
    TinyWorldStage,
    models=("TinyWorldPipeline",),
    defaults={"frames_per_chunk": 2, "sink_frames": 2, "window_frames": 6},
    presets=(
        Preset("tiny-world", {"default_frames": 6}, seed=7, description="a made-up family",
               transformer={"num_attention_heads": 1}),
    ),
)


def test_a_new_family_resolves_and_generates_through_one_plugin(causalkv_home: str, pm) -> None:
    with temporary_plugin(pm, RecordsPlugin(stages=[REGISTRATION])):
        res = resolve("tiny-world", ServerArgs(), pm=pm)
        assert res.stage is TinyWorldStage and res.stage_name == "tiny-world"
        plan, run = plan_and_run(make_options("tiny-world", prompts=["a", "b"], quant="int2"), pm)
        metrics = run_report(plan, run)
        folder = preset_dir("tiny-world")
        # the preset folder copied without causalkv.json still gets the family's defaults
        bare = Path(causalkv_home) / "bare-tiny-world"
        shutil.copytree(folder, bare)
        (bare / "causalkv.json").unlink()
        bare_info = read_model_folder(bare, pm=pm)
    # defaults (2 frames/chunk, sink 2, window 6) under the preset's own settings (6 frames)
    s = plan.settings
    assert (s.frames_per_chunk, s.sink_frames, s.window_frames) == (2, 2, 6)
    assert plan.chunk_prompts == ["a (part 0)", "a (part 1)", "b (part 2)"]
    assert run.stage.name == "tiny-world" and metrics["stage"] == "tiny-world"
    assert metrics["tiny_world_chunks"] == 3
    assert metrics["cache"] == "qvg"
    assert run.latents.shape[2] == 6 and run.stage.caches.kv[0].spec.num_heads == 1
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "TinyWorldPipeline"
    cfg = bare_info.config
    assert (cfg.frames_per_chunk, cfg.sink_frames, cfg.window_frames) == (2, 2, 6)


def test_without_the_plugin_the_family_is_unknown(pm) -> None:
    import pytest

    from causalkv.plugin import ResolutionError

    with pytest.raises(ResolutionError, match="no registered stage serves model tiny-world"):
        resolve("tiny-world", pm=pm)
