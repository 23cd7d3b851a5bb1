"""``make run-vllm-omni``'s second table: realtime sessions on vLLM-Omni's paged AR-diffusion
engine on a CPU, vLLM-Omni's own pool against causalkv's pages.

``Omni(model=DIR, engine_backend=ARDiffusionEngine, model_config={...})`` on the tiny
LingBot-World checkpoint (``causalkv vllm-omni-checkpoint``, RANDOM weights), once per setting:
``stock`` (no ``causalkv_kv_cache``: vLLM-Omni's ``ARDiffusionKVCache``) and causalkv's pages at
each ``--settings`` value; two sessions interleaved, ``--ticks`` typed ticks each (one 3-frame
block per request, ``extra_args["ar_diffusion_tick"]``), same seed, image, prompt and camera
actions for both. Each row: the cache the engine's runner built, the sessions it admits at the
pinned free memory, the pool pages and bytes one session holds after the last tick (read from
the runner's cache: the worker runs in this process), its packed bytes, the bytes against
stock's, the latents' largest drift from stock's, and whether the two sessions' latents are
equal. See demo/vllm_omni/paged_sessions.py and docs/vllm_omni.md ("Realtime sessions on the
paged engine").

    PYTHONPATH=demo/vllm_omni/cpu_stand_ins .venv-vllm-omni/bin/python demo/vllm_omni/run_paged.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

#: what ``--settings`` takes besides ``stock`` (always run first: the reference)
CHOICES = ("off", "int4", "int2")
SESSIONS = ("a", "b")
#: the free memory the CPU platform reports to the engine's admission
FREE_MEMORY = 1 << 30


def _say(text: str) -> None:
    print(textwrap.fill(text, 100, break_on_hyphens=False))


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows)


def _run(folder: Path, work: Path, setting: str, ticks: int) -> dict:
    import paged_sessions as ps

    start = time.perf_counter()
    with ps.engine(folder, work, setting, free_memory=FREE_MEMORY) as omni:
        ready = time.perf_counter()
        latents = ps.interleave(omni, ps.image(), SESSIONS, ticks)
        done = time.perf_counter()
        cache = ps.newest_cache(stock=setting == "stock")
        page = cache.spec.page_size_bytes * cache.num_layers
        per = {}
        for s in SESSIONS:
            pages = ps.pool_pages(cache, s)
            if setting == "stock":
                per[s] = {"pages": pages, "pool_bytes": pages * page, "packed_bytes": 0,
                          "packed_groups": 0, "packed_reads": 0}
            else:
                rep = cache.report(f"ar::{s}::main")
                per[s] = {"pages": rep.pages, "pool_bytes": rep.pool_bytes,
                          "packed_bytes": rep.packed_bytes, "packed_groups": len(rep.packed_groups),
                          "packed_reads": rep.packed_reads}
        return {"setting": setting, "cache": type(cache).__name__, "capacity": cache.session_capacity,
                "uncapped": _uncapped(cache),
                "pool_blocks": cache.num_blocks, "page_bytes": page, "sessions": per,
                "latents": latents, "init_s": round(ready - start, 1),
                "ticks_s": round(done - ready, 1)}


def _uncapped(cache) -> int:
    """The sessions the cache's bytes alone admit (no declared cap): the engine's formula on its
    own geometry (`causalkv.vllm_omni.admission.admit`)."""
    from causalkv.vllm_omni.admission import admit, stock_layout
    from causalkv.vllm_omni.paged_cache import CausalKVPagedKVCache, engine_geometry

    if isinstance(cache, CausalKVPagedKVCache):
        return cache.admission.capacity
    eng = engine_geometry(
        cache.config, num_layers=cache.num_layers, num_kv_heads=cache.num_kv_heads,
        head_size=cache.head_size, dtype=cache.dtype, block_size=cache.block_size,
        kv_branches=cache.kv_branches, cross_attention_lengths=cache.cross_attention_lengths,
        cross_attention_kv_heads=cache.cross_attention_kv_heads,
        frames_per_block=cache.frames_per_block,
        model_owned_state_bytes_per_session=cache.model_owned_state_bytes_per_session)
    return admit(eng, stock_layout(eng), available_bytes=cache.available_memory_bytes,
                 gpu_memory_fraction=cache.config.gpu_memory_fraction).capacity


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="off,int2",
                        help=f"comma-separated kv_cache_quant values beside stock, from {', '.join(CHOICES)} "
                             "(default off,int2)")
    parser.add_argument("--ticks", type=int, default=6, help="ticks per session (default 6)")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    if any(s not in CHOICES for s in settings) or len(set(settings)) != len(settings):
        parser.error(f"--settings: distinct names from {', '.join(CHOICES)}, got {args.settings!r}")
    if args.ticks < 1:
        parser.error(f"--ticks must be 1 or more, got {args.ticks}")
    from causalkv.cli.vllm_omni_checkpoint import build

    work = Path(tempfile.mkdtemp(prefix="causalkv-vo-paged-"))
    try:
        folder, _ = build(work / "lingbot")
        runs = []
        for setting in ("stock", *settings):
            run = _run(folder, work, setting, args.ticks)
            print(f"Omni(engine_backend=ARDiffusionEngine) {setting}: engine up in {run['init_s']} s, "
                  f"{len(SESSIONS)} x {args.ticks} ticks in {run['ticks_s']} s", flush=True)
            runs.append(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = _rows(runs)
    print()
    _say("causalkv inside vLLM-Omni 0.30.0's paged AR-diffusion engine (ARDiffusionEngine, "
         "realtime ticks through Omni(...).generate): tiny LingBot-World checkpoint with RANDOM "
         "weights (2 layers x 2 heads x 64, float32, 16 tokens per latent frame, sink 3 + window 6 "
         f"frames); {len(SESSIONS)} sessions interleaved, {args.ticks} ticks of 3 latent frames "
         f"each, same seed; free memory pinned at {FREE_MEMORY:,} B; bytes per session after the "
         "last tick, read from the engine's own session cache")
    print(_table(rows))
    _say("pool: the session's bf16 pages (one latent frame of K and V in every layer each); "
         "packed: causalkv's records of its packed ticks; stock holds sink + window frames, the "
         "oldest window tick unread by any later forward; causalkv holds what the next tick "
         "reads. sessions: what the engine admits at this memory (stock: LingBot's declared cap "
         "of 2; causalkv's pipeline declares what fits); no cap: what the bytes alone admit, "
         "here nearly the same for every row: LingBot's per-session model state (38.9 MiB at "
         "this geometry) dwarfs a few hundred KB of K/V. At LingBot-World's geometry see "
         "`causalkv memory lingbot --host vllm-omni --budget 80GiB`.")
    _say("(*) the weights are random: the drift says how far a setting's latents move from "
         "stock's on the same ticks, not how good a video is.")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "ticks": args.ticks, "rows": rows,
            "runs": [{k: v for k, v in r.items() if k != "latents"} for r in runs],
            "drift": {r["setting"]: _drift(r, runs[0]) for r in runs},
            "sessions_equal": {r["setting"]: _equal(r) for r in runs},
        }) + "\n")
    return 0


def _drift(run: dict, stock: dict) -> float:
    return max(float((run["latents"][k] - stock["latents"][k]).abs().max()) for k in stock["latents"])


def _equal(run: dict) -> bool:
    import torch

    lat = run["latents"]
    return all(torch.equal(lat[(SESSIONS[0], i)], lat[(s, i)]) for s in SESSIONS
               for (_, i) in lat if _ == SESSIONS[0])


def _rows(runs: list[dict]) -> list[tuple[str, ...]]:
    stock = runs[0]
    base = stock["sessions"][SESSIONS[0]]["pool_bytes"]
    rows = [("setting", "session cache", "sessions", "no cap", "pool pages/session", "pool bytes/session",
             "packed bytes/session", "bytes vs stock", "latent drift vs stock (*)", "a == b")]
    for run in runs:
        s = run["sessions"][SESSIONS[0]]
        total = s["pool_bytes"] + s["packed_bytes"]
        d = _drift(run, stock)
        rows.append((run["setting"], run["cache"], str(run["capacity"]), str(run["uncapped"]), str(s["pages"]),
                     f"{s['pool_bytes']:,}", f"{s['packed_bytes']:,}", f"{total / base:.2f}",
                     "identical" if d == 0 else f"{d:.2e}", "yes" if _equal(run) else "no"))
    return rows


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
