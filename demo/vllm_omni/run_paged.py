"""``make run-vllm-omni``'s second table: realtime sessions on vLLM-Omni's paged AR-diffusion
engine on a CPU, vLLM-Omni's own pool against causalkv's pages, at one memory budget.

``Omni(model=DIR, engine_backend=ARDiffusionEngine, model_config={...})`` on the tiny
LingBot-World checkpoint (``causalkv vllm-omni-checkpoint``, RANDOM weights), typed ticks (one
3-frame block per request, ``extra_args["ar_diffusion_tick"]``), the same seed, image, prompt
and camera actions for every session:

1. int2 with one session alone (the single-session reference); its cache gives the bytes of
   an int2 session and the fixed part at this geometry, so the budget is the free memory at
   which int2 admits exactly ``N`` sessions, ``N`` being what int2 admits at LingBot-World's
   geometry at 80 GiB (`causalkv.vllm_omni.admission.plan_admission`: 5, 2.5x stock's 2);
2. at that budget, ``stock`` (no ``causalkv_kv_cache``: vLLM-Omni's ``ARDiffusionKVCache``) and
   causalkv's pages at each ``--settings`` value, each running as many sessions interleaved as
   its engine admits (at most ``N``), ``--ticks`` ticks each.

Each row: the cache the engine's runner built, the sessions it admits and how many the bytes
alone admit, the sessions run, the pool pages and bytes one session holds after the last tick
(read from the runner's cache: the worker runs in this process), its packed bytes, the bytes
against stock's, the latents' largest drift from stock's, whether all sessions' latents are
equal, and (int2) whether each equals the session run alone. See
demo/vllm_omni/paged_sessions.py and docs/vllm_omni.md ("Realtime sessions on the paged engine").

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
#: the session names, in the order they are opened
NAMES = "abcdefghijklmnopqrstuvwxyz"
#: the free memory of the single-session run (any memory that fits one session)
SOLO_MEMORY = 1 << 30


def _say(text: str) -> None:
    print(textwrap.fill(text, 100, break_on_hyphens=False))


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows)


def _run(folder: Path, work: Path, setting: str, ticks: int, free_memory: int, most: int) -> dict:
    import paged_sessions as ps

    start = time.perf_counter()
    with ps.engine(folder, work, setting, free_memory=free_memory) as omni:
        ready = time.perf_counter()
        cache = ps.newest_cache(stock=setting == "stock")
        names = NAMES[:min(cache.session_capacity, most)]
        latents = ps.interleave(omni, ps.image(), names, ticks)
        done = time.perf_counter()
        adm = ps.admission(cache)
        return {"setting": setting, "cache": type(cache).__name__, "capacity": cache.session_capacity,
                "uncapped": adm.capacity, "session_bytes": adm.session_bytes,
                "fixed_bytes": adm.fixed_bytes, "free_memory": free_memory,
                "cross_bytes": cache.cross_attention_bytes_per_session,
                "model_state_bytes": cache.model_owned_state_bytes_per_session,
                "text_tokens": sum(cache.cross_attention_lengths.values()),
                "tokens_per_frame": cache.block_size,
                "pool_blocks": cache.num_blocks, "sessions": {s: ps.held(cache, s) for s in names},
                "latents": latents, "init_s": round(ready - start, 1),
                "ticks_s": round(done - ready, 1)}


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
    import paged_sessions as ps

    from causalkv.runtime.tools.checkpoints import build_checkpoint

    stock_n, n = ps.wanted()
    work = Path(tempfile.mkdtemp(prefix="causalkv-vo-paged-"))
    try:
        folder = build_checkpoint("lingbot-world", work / "lingbot", host="vllm-omni")
        solo = _run(folder, work, "int2", args.ticks, SOLO_MEMORY, 1)
        budget = solo["fixed_bytes"] + n * solo["session_bytes"]  # int2 admits exactly n
        runs = []
        for setting in ("stock", *settings):
            run = _run(folder, work, setting, args.ticks, budget, n)
            print(f"Omni(engine_backend=ARDiffusionEngine) {setting}: engine up in {run['init_s']} s, "
                  f"{len(run['sessions'])} x {args.ticks} ticks in {run['ticks_s']} s", flush=True)
            runs.append(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = _rows(runs, solo)
    print()
    _say("causalkv inside vLLM-Omni 0.30.0's paged AR-diffusion engine (ARDiffusionEngine, "
         "realtime ticks through Omni(...).generate): tiny LingBot-World checkpoint with RANDOM "
         "weights (2 layers x 2 heads x 64, float32, 16 tokens per latent frame, sink 3 + window 6 "
         f"frames); {args.ticks} ticks of 3 latent frames per session, sessions interleaved, same "
         f"seed; free memory pinned at {budget:,} B, where int2 admits exactly {n} sessions "
         f"(int2's count at LingBot-World's geometry at 80 GiB, against stock's {stock_n}); each "
         "row runs as many sessions as its engine admits; bytes per session after the last tick, "
         "read from the engine's own session cache")
    print(_table(rows))
    stock, int2 = runs[0], next((r for r in runs if r["setting"] == "int2"), None)
    kv = stock["sessions"][NAMES[0]]["pool_bytes"]
    _say("pool: the session's bf16 pages (one latent frame of K and V in every layer each); "
         "packed: causalkv's records of its packed ticks; stock holds sink + window frames, the "
         "oldest window tick unread by any later forward; causalkv holds what the next tick "
         "reads. sessions: what the engine admits at this memory (stock: LingBot's declared cap "
         f"of {stock_n}; causalkv's pipeline declares what fits); no cap: what the bytes alone "
         "admit; run: the sessions run, interleaved; alone: each int2 session's latents against "
         "the same session run alone (one session, first).")
    _say(f"The engine counts a stock session as {stock['session_bytes']:,} B here: {kv:,} B of "
         f"K/V pages ({stock['sessions'][NAMES[0]]['pages'] * stock['tokens_per_frame']} tokens), "
         f"{stock['cross_bytes']:,} B of text cross-attention ({stock['text_tokens']} tokens) and {stock['model_state_bytes']:,} B of model-owned state (vLLM-Omni's "
         "declaration, its streaming VAE decoder's per output pixel)"
         + (f"; an int2 session is {int2['session_bytes']:,} B, so the bytes alone admit "
            f"{stock['uncapped']} stock sessions against int2's {int2['uncapped']}" if int2 else "")
         + f". {n} sessions is what int2 admits where the K/V dominates (LingBot-World's geometry: "
         "`causalkv memory lingbot --host vllm-omni --budget 80GiB`); this run shows the engine "
         "holding that many sessions at once, each as it runs alone.")
    _say("(*) the weights are random: the drift says how far a setting's latents move from "
         "stock's on the same ticks, not how good a video is.")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "ticks": args.ticks, "rows": rows, "budget": budget, "wanted": {"stock": stock_n, "int2": n},
            "solo": {k: v for k, v in solo.items() if k != "latents"},
            "runs": [{k: v for k, v in r.items() if k != "latents"} for r in runs],
            "drift": {r["setting"]: _drift(r, runs[0]) for r in runs},
            "sessions_equal": {r["setting"]: _equal(r) for r in runs},
            "alone": {r["setting"]: _drift(r, solo) for r in runs if r["setting"] == solo["setting"]},
        }) + "\n")
    return 0


def _drift(run: dict, ref: dict) -> float:
    """The largest difference of any session's latents from the reference's first session's
    on the same tick."""
    first = NAMES[0] if (NAMES[0], 0) in ref["latents"] else next(iter(ref["latents"]))[0]
    return max(float((x - ref["latents"][(first, i)]).abs().max()) for (_, i), x in run["latents"].items())


def _equal(run: dict) -> bool:
    import torch

    lat = run["latents"]
    return all(torch.equal(x, lat[(NAMES[0], i)]) for (_, i), x in lat.items())


def _rows(runs: list[dict], solo: dict) -> list[tuple[str, ...]]:
    stock = runs[0]
    base = stock["sessions"][NAMES[0]]["pool_bytes"]
    rows = [("setting", "session cache", "sessions", "no cap", "run", "pool pages/session",
             "pool bytes/session", "packed bytes/session", "bytes vs stock",
             "latent drift vs stock (*)", "all equal", "vs alone")]
    for run in runs:
        s = run["sessions"][NAMES[0]]
        total = s["pool_bytes"] + s["packed_bytes"]
        d = _drift(run, stock)
        alone = "-"
        if run["setting"] == solo["setting"]:
            a = _drift(run, solo)
            alone = "identical" if a == 0 else f"{a:.2e}"
        rows.append((run["setting"], run["cache"], str(run["capacity"]), str(run["uncapped"]),
                     str(len(run["sessions"])), str(s["pages"]), f"{s['pool_bytes']:,}",
                     f"{s['packed_bytes']:,}", f"{total / base:.2f}",
                     "identical" if d == 0 else f"{d:.2e}", "yes" if _equal(run) else "no", alone))
    return rows


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
