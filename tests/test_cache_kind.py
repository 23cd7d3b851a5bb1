"""A new cache kind in one plugin module (this one), through the documented protocol only
(`causalkv.hooks.CacheKind`, docs/plugins.md "A cache kind"): its own settings record, its
own request check before anything loads, its own header lines and its own report in the
metrics (``kv_packing``), all called by the host through the cache factory."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import pytest
from runtime_helpers import make_options, plan_and_run

from causalkv.caches.dense import DenseCausalKVCache
from causalkv.capabilities import CacheCapabilities
from causalkv.errors import ConfigError
from causalkv.hooks import CacheFactory, hookimpl
from causalkv.options import CacheOptions, option
from causalkv.plugin.testing import temporary_plugin
from causalkv.runtime.host.plan_step import plan_generation
from causalkv.runtime.host.report import describe_plan, describe_stream, run_report


@dataclass(frozen=True)
class TallyOptions(CacheOptions):
    title = "tally cache"
    limit: int = option(0, flag="--tally-limit", type=int, minimum=0, help="channels the tally reads")

    def describe(self) -> str:
        return f"tally(limit={self.limit})"


class TallyReport:
    """What one tally cache counted; merged over every cache of the run."""

    def __init__(self, writes: int) -> None:
        self.writes = writes

    @classmethod
    def merge(cls, reports: list[TallyReport]) -> TallyReport:
        return cls(sum(r.writes for r in reports))

    def to_dict(self) -> dict[str, Any]:
        return {"writes": self.writes}


class TallyCache(DenseCausalKVCache):
    """The dense cache, counting its writes."""

    capabilities = CacheCapabilities(DenseCausalKVCache.capabilities.features | {"tally:count"})

    def __init__(self, spec: Any, options: TallyOptions | None = None) -> None:
        super().__init__(spec)
        self.writes = 0

    def update_and_get_attention_kv(self, **kwargs: Any) -> Any:
        self.writes += 1
        return super().update_and_get_attention_kv(**kwargs)

    # ---- the CacheKind calls --------------------------------------------------------------
    @classmethod
    def check_request(cls, options: TallyOptions | None, *, head_dim: int, device: str) -> None:
        if options is not None and options.limit > head_dim:
            raise ConfigError(f"--tally-limit {options.limit} exceeds head_dim {head_dim}; pass at most {head_dim}")

    @classmethod
    def describe_request(cls, options: TallyOptions | None, *, tokens_per_chunk: int, sink_tokens: int) -> list[str]:
        return [f"tally: counting the writes of {tokens_per_chunk} tokens per chunk"]

    def packing_report(self) -> TallyReport:
        return TallyReport(self.writes)


@hookimpl
def causalkv_register_cache_factories() -> list[CacheFactory]:
    return [CacheFactory("tally", TallyCache, priority=20, options=TallyOptions)]


THIS_PLUGIN = sys.modules[__name__]


def test_the_host_calls_the_new_kinds_check_description_and_report(causalkv_home: str, pm) -> None:
    with temporary_plugin(pm, THIS_PLUGIN, "tally-plugin"):
        plan, run = plan_and_run(make_options("tiny-wan", options=[TallyOptions(limit=4)]), pm)
        header = describe_plan(plan) + describe_stream(plan, run.stage.settings)
        metrics = run_report(plan, run)
        with pytest.raises(ConfigError, match="--tally-limit 999 exceeds head_dim 64; pass at most 64"):
            plan_generation(make_options("tiny-wan", options=[TallyOptions(limit=999)]), pm=pm)
    assert plan.resolution.cache_factory.name == "tally"
    assert header[2] == "cache: tally (tally cache: tally(limit=4))"
    assert f"  - tally: counting the writes of {plan.settings.tokens_per_chunk} tokens per chunk" in header
    caches = [c for cs in run.stage.cache_sets() for c in cs.kv]
    assert all(type(c) is TallyCache for c in caches)
    assert metrics["kv_packing"] == {"writes": sum(c.writes for c in caches)} and metrics["kv_packing"]["writes"] > 0
    assert metrics["cache_options"] == "tally(limit=4)"


def test_a_kind_without_the_calls_gets_the_defaults(causalkv_home: str, pm) -> None:
    plan, run = plan_and_run(make_options("tiny-wan"), pm)  # the dense cache defines none of them
    assert plan.resolution.cache_factory.name == "dense"
    assert describe_plan(plan)[2] == "cache: dense (no settings)"
    assert run_report(plan, run)["kv_packing"] is None
