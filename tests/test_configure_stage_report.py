"""What a run reports is what ran: a ``causalkv_configure_stage`` override of the stream
settings shows in the metrics (returned and written) and in the ``stream:`` header line, not
the plan's value."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from runtime_helpers import make_options

from causalkv.hooks import hookimpl
from causalkv.plugin.testing import temporary_plugin
from causalkv.runtime.host.generate import generate


class NarrowWindow:
    @hookimpl
    def causalkv_configure_stage(self, stage):
        return {"window_frames": 6}


def _generate(pm, tmp_path: Path, name: str) -> tuple[dict, dict, list[str], object]:
    lines: list[str] = []
    options = replace(make_options("tiny-wan"), metrics=tmp_path / f"{name}.json")
    metrics, run = generate(options, pm=pm, log=lines.append)
    return metrics, json.loads((tmp_path / f"{name}.json").read_text()), lines, run


def test_an_override_of_the_window_shows_in_the_metrics_and_the_stream_line(
    causalkv_home: str, pm, tmp_path: Path
) -> None:
    planned, planned_file, planned_lines, _ = _generate(pm, tmp_path, "planned")
    assert planned["window_frames"] == planned_file["window_frames"] == 9  # the preset's
    with temporary_plugin(pm, NarrowWindow()):
        metrics, written, lines, run = _generate(pm, tmp_path, "override")
    assert run.stage.settings.window_frames == 6  # the stage ran with the override
    assert metrics["window_frames"] == written["window_frames"] == 6
    assert metrics["cache_frames"] == run.stage.settings.cache_frames
    # the narrower window holds fewer bytes once it is full
    assert metrics["kv_resident_bytes_max"] < planned["kv_resident_bytes_max"]
    (stream,) = [line for line in lines if line.startswith("stream: ")]
    (planned_stream,) = [line for line in planned_lines if line.startswith("stream: ")]
    assert "window 9," in planned_stream
    assert "window 6," in stream and stream == planned_stream.replace("window 9,", "window 6,").replace(
        f"cache {planned['cache_frames']} frames", f"cache {metrics['cache_frames']} frames")
