"""A plugin serves an sglang stage causalkv does not ship: with the ``causalkv-host-plugin``
distribution installed, its ``toy-host`` plugin registers ``ToyLongLive2Stage`` (a trivial
subclass of sglang's LongLive 2.0 stage) for pipeline ``ToyLongLive2Pipeline``, packing with
``toy-codec``'s int8. The bridge serves exactly the classes the registry names: the hooks on
sglang's base methods run for the subclass (it inherits the wrapped methods), its cache is the
bridge's ``SGLangQVGKVCache`` packing with the registration's codec, and the bridge's log names
what it serves in one line. The plugin switches of causalkv's runtime hold: a blocked plugin's
stage keeps sglang's behaviour; a plugin whose registration raises (``raising-host``) is set
aside with one line, every other one served; a registered class the hooks cannot reach is one
warning and not served.

The distribution is pip-installed into a folder put on ``sys.path`` and found through
importlib.metadata by a fresh process-wide plugin manager (`plugin_dists.found_in_process`), as
in an sglang process where it is installed; stages are built with ``__new__`` as in
test_bridge_stages.py (no server, no weights)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
    CausalSelfAttentionKVCache,
)
from test_bridge_stages import HEAD_DIM, _allocate, _stage, stored_after_seven_chunks

from causalkv.errors import ConfigError
from causalkv.hooks import HostClassRegistration, hookimpl
from causalkv.plugin import get_plugin_manager
from causalkv.plugin.manager import ENV_BLOCK
from causalkv.sglang import targets
from causalkv.sglang.cache import SGLangQVGKVCache
from causalkv.sglang.settings import check_settings
from causalkv.sglang.stages import summary_line

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # plugin_dists, the test distributions' installer
    sys.path.insert(0, str(TESTS))
from plugin_dists import found_in_process, install  # noqa: E402

BUILTIN = {"LongLive2Pipeline", "WanCausalDMDPipeline", "LingBotWorldCausalDMDPipeline"}
#: a limit causalkv's codec refuses at start-up (cluster ids are uint8)
TOO_MANY_CENTROIDS = QVGKVQuantArgs(bits=2, centroids=512)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install("causalkv-host-plugin", tmp_path_factory.mktemp("host-dist"))


@pytest.fixture
def installed(site: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """The distribution found as installed by this process (`found_in_process`), the bridge's
    once-per-process log lines logged afresh, and sglang's toy stage class."""
    monkeypatch.setattr(targets, "_logged", set())
    with found_in_process(site, monkeypatch), caplog.at_level(logging.INFO, logger="causalkv.sglang"):
        yield


def _toy_stage_class() -> type:
    from causalkv_host_plugin.sglang_stage import ToyLongLive2Stage

    return ToyLongLive2Stage


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_plugins_subclass_is_served_with_its_codec_and_logged(installed, caplog):
    """Resolved once (one log line naming every served stage and its plugin), then the toy
    stage is served: sglang's QVG guard passes, the start-up check checks its pipeline, and its
    blocks are the bridge's caches packing with the registration's int8 as its nbytes says."""
    served = targets.served_stages()
    cls = _toy_stage_class()
    assert served["ToyLongLive2Pipeline"].cls is cls and served["ToyLongLive2Pipeline"].plugin == "toy-host"
    assert set(served) == BUILTIN | {"ToyLongLive2Pipeline"}
    assert targets.served_stages() is served  # once per process
    (line,) = _messages(caplog, "causalkv sglang bridge serves")
    assert "LongLive2Pipeline: LongLive2CausalDenoisingStage (plugin causalkv.builtin, cache sglang)" in line
    assert line.endswith("ToyLongLive2Pipeline: ToyLongLive2Stage (plugin toy-host, cache toy-sglang, codec int8)")
    from causalkv_host_plugin.sglang_cache import ToySGLangCache

    assert served["ToyLongLive2Pipeline"].cache is ToySGLangCache  # the registration's cache factory
    assert served["LongLive2Pipeline"].cache is SGLangQVGKVCache  # the built-in one, "sglang"

    stage = _stage(cls)
    assert stage._supports_qvg_kv_cache_quantization() is True  # sglang's guard: served
    check_settings("ToyLongLive2Pipeline", QVGKVQuantArgs(bits=2), HEAD_DIM)  # start-up: accepted
    with pytest.raises(ConfigError, match="ToyLongLive2Pipeline: .*centroids"):
        check_settings("ToyLongLive2Pipeline", TOO_MANY_CENTROIDS, HEAD_DIM)
    stage._kv_quant_args = QVGKVQuantArgs(bits=2)  # sglang's --kv-cache-quant int2 turns QVG on
    blocks = _allocate(stage)
    assert all(type(c) is ToySGLangCache for c in blocks)  # built by the registration's factory
    assert {c.quant.codec for c in blocks} == {"int8"}  # the registration's codec
    (alloc,) = _messages(caplog, "causalkv sglang bridge: ToyLongLive2Stage KV cache")
    assert "causalkv_host_plugin.sglang_cache.ToySGLangCache x 2 blocks, served by causalkv, qvg(int8" in alloc
    packed = stored_after_seven_chunks(blocks[0])
    assert packed and {s.codec.name for s in packed} == {"int8"}
    assert all(s.nbytes == 2 * s.codec.nbytes(s.k.shape) for s in packed)  # K and V, as it predicts
    assert "stage=ToyLongLive2Stage cache=ToySGLangCache codec=int8" in summary_line(stage, [blocks])


def test_causalkv_sglang_codec_still_overrides_the_registrations_codec(installed, monkeypatch):
    monkeypatch.setenv("CAUSALKV_SGLANG_CODEC", "fp8")
    stage = _stage(_toy_stage_class())
    stage._kv_quant_args = QVGKVQuantArgs(bits=2)
    assert {c.quant.codec for c in _allocate(stage)} == {"fp8"}


def test_a_blocked_plugins_stage_keeps_sglangs_behaviour(installed, monkeypatch, caplog):
    """``CAUSALKV_DISABLE_PLUGINS=toy-host`` (as in ``causalkv generate``): the stage is not
    served (sglang's guard, sglang's own caches, no start-up check), the built-in ones are."""
    monkeypatch.setenv(ENV_BLOCK, "toy-host")
    assert set(targets.served_stages()) == BUILTIN
    (line,) = _messages(caplog, "causalkv sglang bridge serves")
    assert "Toy" not in line
    stage = _stage(_toy_stage_class())
    assert stage._supports_qvg_kv_cache_quantization() is False  # sglang's own answer
    check_settings("ToyLongLive2Pipeline", TOO_MANY_CENTROIDS, HEAD_DIM)  # not the bridge's to judge
    stage._kv_quant_args = QVGKVQuantArgs(bits=2)  # QVG on: stock sglang's dense cache, no bridge line
    assert {type(c) for c in _allocate(stage)} == {CausalSelfAttentionKVCache}
    assert not _messages(caplog, "ToyLongLive2Stage")


def test_a_raising_registration_sets_its_plugin_aside_and_the_others_are_served(installed, capsys):
    """``raising-host``'s ``causalkv_register_host_classes`` raises: one line on stderr names
    it and the fix, as in causalkv's runtime; the toy stage and the built-in ones are served."""
    assert set(targets.served_stages()) == BUILTIN | {"ToyLongLive2Pipeline"}
    err = capsys.readouterr().err
    assert ("causalkv: warning: plugin 'raising-host' (from causalkv-host-plugin 0.1.0) is set aside: "
            "causalkv_register_host_classes() raised RuntimeError: the host-class registration fails "
            "on purpose; fix the plugin, or turn it off with CAUSALKV_DISABLE_PLUGINS=raising-host") in err


class _Unreachable:
    """A registration the hooks cannot reach (not a causal DMD stage), one that does not import,
    and one whose cache factory builds causalkv's contract, not sglang's blocks."""

    @hookimpl
    def causalkv_register_host_classes(self):
        stage = f"{targets.STAGES}.causal_denoising:CausalDMDDenoisingStage"
        return [HostClassRegistration("sglang", "causalkv.sglang.cache:SGLangQVGKVCache", "OddPipeline"),
                HostClassRegistration("sglang", "causalkv_host_plugin.missing:Stage", "GonePipeline"),
                HostClassRegistration("sglang", stage, "PackedPipeline", cache="toy-packed")]


def test_a_class_the_hooks_cannot_reach_is_one_warning_and_not_served(installed, caplog):
    get_plugin_manager().register_plugin(_Unreachable(), "unreachable")
    assert set(targets.served_stages()) == BUILTIN | {"ToyLongLive2Pipeline"}
    odd, gone, packed = _messages(caplog, "is not served")
    assert packed.startswith("causalkv sglang bridge: PackedPipeline is not served: ")
    assert ("TypeError: cache 'toy-packed' (causalkv_host_plugin.caches:ToyPackedCache) is not a subclass of "
            "causalkv.sglang.cache.SGLangQVGKVCache declaring capability host:sglang") in packed
    assert odd.startswith("causalkv sglang bridge: OddPipeline is not served: causalkv.sglang.cache:"
                          "SGLangQVGKVCache (plugin unreachable): TypeError: ")
    assert "is not a subclass of sglang's CausalDMDDenoisingStage" in odd
    assert ("GonePipeline is not served: causalkv_host_plugin.missing:Stage (plugin unreachable): "
            "ModuleNotFoundError: No module named 'causalkv_host_plugin.missing'") in gone
    assert odd.endswith("turn it off with CAUSALKV_DISABLE_PLUGINS=unreachable")
