"""Plugin discovery plus resolution with 50 registered third-party plugins.

Target (issue): at most 20 ms, excluding the torch import. torch, causalkv.config and the
stage modules are imported before timing starts; everything else is timed.

Each of the 50 plugins is a module reached through an entry point of group ``causalkv``
(like an installed distribution) that registers one stage serving two models and one cache
factory. One run = scan installed entry points + import/register/validate the 50 plugins +
collect the registries (conflict checks) + three resolutions.

    .venv/bin/python benchmarks/plugins.py [--plugins 50] [--repeat 30] [--json] [--check]
    .venv/bin/python benchmarks/plugins.py --quick    # 3 timed runs (smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from importlib.metadata import EntryPoint

import torch  # noqa: F401  (excluded from the timing on purpose)

import causalkv.config  # noqa: F401
import causalkv.stages  # noqa: F401
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.config import ServerArgs
from causalkv.hooks import CacheFactory, StageRegistration, hookimpl
from causalkv.plugin import collect, make_plugin_manager
from causalkv.plugin.manager import discover_entry_points
from causalkv.runtime import resolve

TARGET_MS = 20.0
FEATURES = ("pinned_sink", "head_slice", "recent_window", "growth", "int_indices")


def make_plugin_modules(n: int) -> list[EntryPoint]:
    """``n`` importable plugin modules (in sys.modules) and their entry points."""
    eps = []
    for i in range(n):
        name = f"causalkv_bench_plugin_{i}"
        stage = StageRegistration(
            f"bench-stage-{i}",
            "causalkv.stages.longlive:LongLiveStage",
            models=(f"bench-model-{i}", f"BenchPipeline{i}"),
        )
        cache = CacheFactory(
            f"bench-cache-{i}",
            "causalkv.caches.dense:DenseCausalKVCache",
            capabilities=(*FEATURES, f"bench:{i}"),
            priority=-1 - i,
        )
        mod = types.ModuleType(name)
        mod.causalkv_register_stages = hookimpl(lambda stage=stage: [stage])
        mod.causalkv_register_cache_factories = hookimpl(lambda cache=cache: [cache])
        sys.modules[name] = mod
        eps.append(EntryPoint(name=f"bench-{i}", value=name, group="causalkv"))
    return eps


def one_run(fake: list[EntryPoint], n: int) -> dict[str, float]:
    t0 = time.perf_counter()
    eps = [*discover_entry_points(), *fake]
    t1 = time.perf_counter()
    pm = make_plugin_manager(env={}, entry_points=eps)
    t2 = time.perf_counter()
    registry = collect(pm)
    t3 = time.perf_counter()
    quant = ServerArgs(options=[QVGKVQuantArgs(codec="int4")], multi_shot=True)
    results = [
        resolve("tiny-longlive2", quant, pm=pm),
        resolve("tiny-wan", ServerArgs(), pm=pm),
        resolve(f"BenchPipeline{n // 2}", ServerArgs(), pm=pm),
    ]
    t4 = time.perf_counter()
    assert len(registry.stages) == 4 + n and len(registry.caches) == 3 + n  # dense, qvg, sglang
    assert [r.cache_factory.name for r in results] == ["qvg", "dense", "dense"]
    return {
        "scan_ms": (t1 - t0) * 1e3,
        "load_ms": (t2 - t1) * 1e3,
        "collect_ms": (t3 - t2) * 1e3,
        "resolve3_ms": (t4 - t3) * 1e3,
        "total_ms": (t4 - t0) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--plugins", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true", help="exit 1 when the median misses the target")
    ap.add_argument("--quick", action="store_true",
                    help="3 timed runs instead of --repeat (a smoke run: the same 50 plugins)")
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.repeat = 3
    fake = make_plugin_modules(ns.plugins)
    cold = one_run(fake, ns.plugins)
    runs = [one_run(fake, ns.plugins) for _ in range(ns.repeat)]
    keys = list(cold)
    median = {k: statistics.median(r[k] for r in runs) for k in keys}
    worst = {k: max(r[k] for r in runs) for k in keys}
    ok = median["total_ms"] <= TARGET_MS
    result = {
        "plugins": ns.plugins,
        "repeat": ns.repeat,
        "target_ms": TARGET_MS,
        "cold": cold,
        "median": median,
        "max": worst,
        "meets_target": ok,
    }
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"plugin discovery + resolution, {ns.plugins} plugins, {ns.repeat} runs "
              f"(torch import excluded)")
        print(f"{'phase':<12}{'cold':>10}{'median':>10}{'max':>10}   (ms)")
        for k in keys:
            print(f"{k:<12}{cold[k]:>10.2f}{median[k]:>10.2f}{worst[k]:>10.2f}")
        print(f"target <= {TARGET_MS:.0f} ms (median total): {'met' if ok else 'MISSED'}")
    return 0 if ok or not ns.check else 1


if __name__ == "__main__":
    sys.exit(main())
