"""Options owned by the extension, through one temporary plugin, touching no causalkv file.

The plugin brings a model family whose stage declares its own request flag (``--world-speed``)
and its own ``causalkv.json`` key (``world_rate``), and a cache whose factory declares its own
setting (``--ring-slack``). The host, which names neither, must show both flags in
``causalkv generate --help`` (each under its owner's group), validate them where they enter
(exit 2, before any weights load), refuse each for an extension that was not chosen with the
one message that names the option, its owner and the chosen one, and hand the stage its
record and the cache its record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fault_helpers import run_cli
from runtime_helpers import make_options, plan_and_run

import causalkv.plugin.manager as plugin_manager
from causalkv.caches.dense import DenseCausalKVCache
from causalkv.config import ServerArgs
from causalkv.errors import ConfigError
from causalkv.hooks import CacheFactory, Preset, StageRegistration
from causalkv.options import CacheOptions, Options, StageOptions, option
from causalkv.plugin.testing import RecordsPlugin, fresh_plugin_manager, temporary_plugin
from causalkv.runtime.host.report import run_report
from causalkv.stages.base import CausalDenoisingStage

RING = "myorg:ring"


@dataclass(frozen=True)
class WorldOptions(StageOptions):
    title = "tiny world knobs"

    speed: float = option(1.0, flag="--world-speed", type=float, help="how fast the world turns")

    def validate(self) -> Any:
        if not self.speed > 0:
            raise ConfigError(f"--world-speed must be > 0, got {self.speed!r}; pass a positive speed")
        return super().validate()


@dataclass(frozen=True)
class WorldConfig(Options):
    title = "tiny world model settings"

    rate: int = option(1, key="world_rate", minimum=1, help="turns per chunk")


class TinyWorldStage(CausalDenoisingStage):
    """A made-up family: needs the ring cache, reports what reached it (its records are
    declared on its registration)."""

    @classmethod
    def required_cache_features(cls, server_args: ServerArgs, model: Any = None) -> frozenset[str]:
        return super().required_cache_features(server_args, model) | {RING}

    def report(self) -> dict[str, Any]:
        return {"world_speed": self.options.speed, "world_rate": self.model.option(WorldConfig).rate}


@dataclass(frozen=True)
class RingOptions(CacheOptions):
    title = "ring cache"

    slack: int = option(0, flag="--ring-slack", type=int, minimum=0, help="spare chunks the ring keeps")

    def describe(self) -> str:
        return f"ring(slack={self.slack})"


#: every settings record a ring cache was built with
BUILT: list[Any] = []


def build_ring(spec: Any, options: Any) -> DenseCausalKVCache:
    BUILT.append(options)
    return DenseCausalKVCache(spec)


PLUGIN = RecordsPlugin(
    stages=[StageRegistration(
        "tiny-world2", TinyWorldStage, models=("TinyWorld2Pipeline",), options=WorldOptions, config=WorldConfig,
        defaults={"frames_per_chunk": 2, "sink_frames": 2, "window_frames": 6},
        presets=(Preset("tiny-world2", {"default_frames": 4, "world_rate": 3}, seed=8,
                        description="a made-up family with knobs of its own"),),
    )],
    caches=[CacheFactory(
        "ring", build_ring, capabilities=["pinned_sink", "head_slice", "recent_window", "growth", RING],
        options=RingOptions,
    )],
)


@pytest.fixture
def cli_pm(monkeypatch: pytest.MonkeyPatch, causalkv_home: str) -> Any:
    """The command line's plugin manager: the built-in plugin plus `PLUGIN`."""
    pm = fresh_plugin_manager()
    monkeypatch.setattr(plugin_manager, "_default", pm)
    with temporary_plugin(pm, PLUGIN):
        yield pm
    BUILT.clear()


def test_both_flags_are_in_generate_help_under_their_owners(cli_pm: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["generate", "--help"]) == 0
    text = capsys.readouterr().out
    world = text.index("tiny world knobs (stage tiny-world2):")
    ring = text.index("ring cache (cache ring):")
    assert "--world-speed WORLD_SPEED" in text[world:] and "how fast the world turns (default: 1.0)" in text
    assert "--ring-slack RING_SLACK" in text[ring:] and "spare chunks the ring keeps (default: 0)" in text
    # the built-in families' and caches' flags come the same way, under their owners
    assert "LongLive 2.0 shots (stage longlive2):" in text and "--shot-durations" in text
    assert "QVG KV-cache quantization (cache qvg):" in text and "--kv-cache-quant-centroids" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "tiny-world2", "--world-speed", "0"], "--world-speed must be > 0, got 0.0; pass a positive speed"),
        (["--model", "tiny-world2", "--ring-slack", "-1"], "--ring-slack must be an int >= 0, got -1"),
        (["--model", "tiny-wan", "--world-speed", "2"],
         "--world-speed applies to stage 'tiny-world2', not to WanCausalDMDStage (stage 'self-forcing-wan'); "
         "drop it or pick a model stage 'tiny-world2' serves"),
        (["--model", "tiny-wan", "--ring-slack", "2"],
         "--ring-slack applies to cache 'ring', not to cache 'dense'; drop it or pick --cache ring"),
        (["--model", "tiny-world2", "--motion", "m,s"],
         "--motion applies to LingBot-World's interactive window, not to TinyWorldStage (stage "
         "'tiny-world2'); it is an option of stage 'lingbot-world'; drop it or pick a LingBot-World model"),
    ],
)
def test_bad_or_foreign_options_are_refused_before_anything_loads(
    cli_pm: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    rc = run_cli(["generate", "--quiet", "--no-video", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err == f"causalkv generate: error: {message}\n"
    assert not BUILT  # no cache was built: refused before the stage (and the weights)


def test_the_stage_and_the_cache_get_their_records(cli_pm: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    metrics = tmp_path / "m.json"
    rc = run_cli(["generate", "--model", "tiny-world2", "--world-speed", "2.5", "--ring-slack", "3",
                  "--quiet", "--no-video", "--dtype", "float32", "--metrics", str(metrics)])
    assert rc == 0, capsys.readouterr().err
    m = json.loads(metrics.read_text())
    assert (m["stage"], m["cache"], m["cache_options"]) == ("tiny-world2", "ring", "ring(slack=3)")
    assert (m["world_speed"], m["world_rate"]) == (2.5, 3)  # the flag, and the preset's causalkv.json key
    assert BUILT == [RingOptions(slack=3)] * 2  # one cache per layer of the 2-layer preset


def test_python_requests_carry_the_same_records(cli_pm: Any) -> None:
    options = make_options("tiny-world2", options=(WorldOptions(speed=4.0),))
    plan, run = plan_and_run(options, cli_pm)
    assert run.stage.options == WorldOptions(speed=4.0)
    assert run.stage.cache_options == RingOptions() and BUILT == [RingOptions()] * 2
    assert run_report(plan, run)["world_speed"] == 4.0
    with pytest.raises(ConfigError, match="--ring-slack applies to cache 'ring', not to cache 'dense'"):
        plan_and_run(make_options("tiny-wan", options=(RingOptions(slack=1),)), cli_pm)
