"""sglang's QVG settings become causalkv's once per request, not at every place that needs them.

The counters wrap the conversions where they are made: sglang's args -> causalkv's
(`causalkv.sglang.cache.causalkv_quant_args` given sglang's args; its calls on causalkv's own
args, which it returns as they are, are not conversions), a ``kv_cache_quant_config`` dict ->
sglang's args (`settings.sglang_quant_args` given a dict), and causalkv's environment settings
(`settings.read_env`). A request is every hook sglang calls for it: the forward context, the
realtime path's overrides, the positive and the CFG allocation; or the whole of LongLive 2.0's
own ``forward``.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.longlive2 import (
    LongLive2CausalDenoisingStage,
)
from test_bridge_stages import INT2, _allocate, _longlive2_run, _server_args, _stage

from causalkv.caches.qvg.options import QVGKVQuantArgs as CausalKVQuant
from causalkv.sglang import cache, settings, stages
from causalkv.sglang.cache import SGLangQVGKVCache


@pytest.fixture
def counts(monkeypatch) -> Counter:
    seen: Counter = Counter()
    to_causalkv, to_sglang, read_env = (cache.causalkv_quant_args, settings.sglang_quant_args,
                                        settings.read_env)

    def causalkv_quant_args(quant, *a, **kw):
        if not isinstance(quant, CausalKVQuant):
            seen["to_causalkv"] += 1
        return to_causalkv(quant, *a, **kw)

    def sglang_quant_args(value):
        if isinstance(value, dict):
            seen["to_sglang"] += 1
        return to_sglang(value)

    def counted_read_env(*a, **kw):
        seen["read_env"] += 1
        return read_env(*a, **kw)

    monkeypatch.setattr(cache, "causalkv_quant_args", causalkv_quant_args)
    monkeypatch.setattr(settings, "sglang_quant_args", sglang_quant_args)
    monkeypatch.setattr(settings, "read_env", counted_read_env)
    return seen


def _request(stage, server_args, *, realtime: bool) -> list:
    """The hooks sglang calls for one request, in its order: the forward context, on the
    realtime path the cache overrides, then the positive and the CFG set's allocations."""
    stages.prepare_forward_context(lambda self, b, s: None, stage, SimpleNamespace(), server_args)
    if realtime:
        stage._apply_causal_cache_overrides(SimpleNamespace(), server_args)
    return [_allocate(stage, global_sink_tokens=16), _allocate(stage)]


@pytest.mark.parametrize("realtime", [False, True], ids=["offline", "realtime"])
def test_one_conversion_per_request(counts, monkeypatch, realtime):
    monkeypatch.setenv("CAUSALKV_SGLANG_RECENT_TIER", "int4")
    stage = _stage(LongLive2CausalDenoisingStage)
    server_args = _server_args({"bits": 2, "centroids": 8, "block_size": 16})  # a dict, as the API takes
    for request in (1, 2, 3):
        sets = _request(stage, server_args, realtime=realtime)
        assert all(type(c) is SGLangQVGKVCache and c.quant.recent_tier == "int4"
                   for blocks in sets for c in blocks)
        # one causalkv settings object serves the request's every block
        assert len({id(c.quant) for blocks in sets for c in blocks}) == 1
        assert counts == {"to_causalkv": request, "read_env": request, "to_sglang": 1}
    # a new request reads the environment again
    monkeypatch.setenv("CAUSALKV_SGLANG_RECENT_TIER", "fp8")
    sets = _request(stage, server_args, realtime=realtime)
    assert {c.quant.recent_tier for blocks in sets for c in blocks} == {"fp8"}
    assert counts["to_causalkv"] == counts["read_env"] == 4


def test_one_conversion_per_allocation_outside_a_request(counts):
    """sglang's code that sets ``_kv_quant_args`` and allocates itself (its unit tests do)."""
    stage = _stage(LongLive2CausalDenoisingStage)
    stage._kv_quant_args = INT2
    _allocate(stage)
    assert counts == {"to_causalkv": 1, "read_env": 1}
    stage._kv_quant_args = QVGKVQuantArgs(bits=4, block_size=16)  # other settings: converted
    assert {c.quant.codec for c in _allocate(stage)} == {"int4"}
    assert counts == {"to_causalkv": 2, "read_env": 2}


def test_one_conversion_per_longlive2_forward(counts, monkeypatch):
    """LongLive 2.0's own ``forward``, every hook sglang applies on its way."""
    _longlive2_run(QVGKVQuantArgs(bits=2, block_size=16, centroids=8), monkeypatch)
    assert counts == {"to_causalkv": 1, "read_env": 1}


def test_quant_off_converts_nothing(counts):
    stage = _stage(LongLive2CausalDenoisingStage)
    for _ in range(2):
        _request(stage, _server_args(QVGKVQuantArgs()), realtime=True)
    assert counts == {}
