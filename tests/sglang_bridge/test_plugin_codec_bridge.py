"""A plugin's codec inside sglang: with the ``causalkv-codec-plugin`` distribution installed (its
toy int8 codec, registered through ``causalkv_register_codecs``), ``CAUSALKV_SGLANG_CODEC=int8``
and ``CAUSALKV_SGLANG_RECENT_TIER=int8`` pass the start-up check, and the caches a served stage
allocates pack with the plugin's codec, its records as many bytes as its ``nbytes`` says; the
plugin switches of causalkv's runtime hold here too (a blocked plugin's codec is unknown).

The distribution is pip-installed into a folder put on ``sys.path`` and found through
importlib.metadata by a fresh process-wide plugin manager, as in a sglang process where it is
installed; stages are built with ``__new__`` as in test_bridge_stages.py (no server, no
weights)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.longlive2 import (
    LongLive2CausalDenoisingStage,
)
from test_bridge_stages import (
    HEAD_DIM,
    INT2,
    _allocate,
    _stage,
    stored_after_seven_chunks,
)

from causalkv.caches import codecs
from causalkv.errors import ConfigError
from causalkv.plugin.manager import ENV_BLOCK, reset_plugin_manager
from causalkv.sglang.settings import check_settings, read_env
from causalkv.sglang.stages import summary_line

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # plugin_dists, the test distributions' installer
    sys.path.insert(0, str(TESTS))
from plugin_dists import found_in_process, install  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install("causalkv-codec-plugin", tmp_path_factory.mktemp("codec-dist"))


@pytest.fixture
def installed(site: Path, monkeypatch: pytest.MonkeyPatch):
    """The distribution found as an installed plugin by this process (`found_in_process`)."""
    with found_in_process(site, monkeypatch):
        yield


@pytest.mark.parametrize(("codec", "tier", "quant", "packed"), [
    # CAUSALKV_SGLANG_CODEC: the plugin's codec packs while sglang's int2 turns QVG on (PRQ's
    # knobs at their defaults: the plugin's codec reads none of them)
    ("int8", None, QVGKVQuantArgs(bits=2), {"int8"}),
    # sglang's int2 packs (as test_bridge_stages.py's INT2: a block dividing head_dim 32, few
    # enough centroids that packing 16 tokens pays), the recency tier the plugin's codec
    (None, "int8", INT2, {"int2", "int8"}),
], ids=["codec", "recent-tier"])
def test_a_plugin_codec_is_a_codec_setting_of_the_bridge(installed, monkeypatch, codec, tier, quant, packed):
    if codec is not None:
        monkeypatch.setenv("CAUSALKV_SGLANG_CODEC", codec)
    if tier is not None:
        monkeypatch.setenv("CAUSALKV_SGLANG_RECENT_TIER", tier)
    assert "int8" not in codecs.codec_names()  # nothing loaded the plugins yet
    assert read_env() == type(read_env())(recent_tier=tier or "bf16", codec=codec)
    check_settings("LongLive2Pipeline", quant, HEAD_DIM)  # start-up: accepted
    stage = _stage(LongLive2CausalDenoisingStage)
    stage._kv_quant_args = quant
    blocks = _allocate(stage)
    assert {(c.quant.codec, c.quant.recent_tier) for c in blocks} == {(codec or "int2", tier or "bf16")}
    segments = stored_after_seven_chunks(blocks[0])
    assert {s.codec.name for s in segments} == packed
    mine = [s for s in segments if s.codec.name == "int8"]
    assert type(mine[0].codec).__module__ == "toy_codec_plugin"
    assert all(s.nbytes == 2 * s.codec.nbytes(s.k.shape) for s in mine)  # K and V, as it predicts
    assert f"codec={codec or 'int2'}" in summary_line(stage, [blocks])


def test_the_plugin_switches_of_causalkvs_runtime_hold_in_the_bridge(installed, monkeypatch):
    """``CAUSALKV_DISABLE_PLUGINS`` (as in ``causalkv generate``): the blocked plugin's codec is
    not a setting, and the refusal lists the codecs there are; unblocked (a new process: a new
    manager), it is one."""
    monkeypatch.setenv(ENV_BLOCK, "toy-codec")
    monkeypatch.setenv("CAUSALKV_SGLANG_CODEC", "int8")
    with pytest.raises(ConfigError, match=r"CAUSALKV_SGLANG_CODEC='int8': choose one of "
                                          r"\['int4', 'int2', 'fp8', 'nvfp4'\]"):
        check_settings("LongLive2Pipeline", QVGKVQuantArgs(bits=2), HEAD_DIM)
    monkeypatch.delenv(ENV_BLOCK)
    reset_plugin_manager()
    check_settings("LongLive2Pipeline", QVGKVQuantArgs(bits=2), HEAD_DIM)


def test_a_broken_plugin_codec_is_refused_at_sglang_start_up(monkeypatch):
    """``CAUSALKV_SGLANG_CODEC`` naming a codec that decodes zeros: sglang's start-up check
    (`check_settings`, before any weights load) stops with one line naming the setting and the
    conformance check it failed; no cache is built."""
    monkeypatch.setattr(codecs, "_SETTINGS", dict(codecs._SETTINGS))
    codecs.register_codec("i8zeros", "toy_codec_plugin:WritesZeros")  # decodes zeros
    monkeypatch.setenv("CAUSALKV_SGLANG_CODEC", "i8zeros")
    with pytest.raises(ConfigError) as e:
        check_settings("LongLive2Pipeline", QVGKVQuantArgs(bits=2), HEAD_DIM)
    line = str(e.value)
    assert "\n" not in line and "setting 'i8zeros'" in line and "conformance check 'bound'" in line
