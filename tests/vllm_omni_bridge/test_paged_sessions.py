"""As many sessions as int2 admits, interleaved through vLLM-Omni's own paged engine on a CPU.

At LingBot-World's geometry int2 admits 2.5x stock's sessions at 80 GiB (5 against 2: the
formula `causalkv.vllm_omni.admission.plan_admission`, checked byte for byte against the
engine's own admission in test_paged_admission.py). Here the engine really holds that many:
``Omni(..., engine_backend=ARDiffusionEngine)`` on the tiny checkpoint (2 layers x 2 heads x
64, float32, 16 tokens per frame, sink 3 + window 6 frames; random weights), at the free memory
where int2 admits exactly that many sessions, runs them all interleaved, six ticks each, the
same seed, image, prompt and camera actions for every session.

The oracles: the same int2 session run alone (one session, its own engine); vLLM-Omni's own
pool (stock) at the same memory, for the latents (drift within what the codec allows) and for
the bytes per session, read from the pool's pages.

At the tiny geometry the bytes alone do not give the 2.5x (stock's bytes admit one session
fewer than int2's at this memory, LingBot's cap of 2 aside): a session's text cross-attention
(512 tokens) and vLLM-Omni's declared model state (its streaming VAE decoder's, per output
pixel) dwarf 144 tokens of K/V. tests/test_vllm_omni_admission.py has the arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from test_paged_engine import _bounded_drift

TICKS = 6
NAMES = "abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """int2 with one session alone (its latents and its cache's admission: one session's bytes
    and the fixed part), then stock and int2 at the budget where int2 admits exactly ``n``
    (int2's count at LingBot-World's geometry at 80 GiB), each running as many sessions as its
    engine admits, interleaved."""
    import paged_sessions as ps

    from causalkv.runtime.tools.checkpoints import build_checkpoint

    work = tmp_path_factory.mktemp("paged-sessions")
    folder = build_checkpoint("lingbot-world", work / "lingbot", host="vllm-omni")
    stock_n, n = ps.wanted()
    src = ps.image()
    with ps.engine(folder, work, "int2") as omni:
        solo = ps.interleave(omni, src, NAMES[:1], TICKS)
        adm = ps.newest_cache().admission
    budget = adm.fixed_bytes + n * adm.session_bytes
    out = {"n": n, "stock_n": stock_n, "budget": budget, "solo": solo}
    for setting in ("stock", "int2"):
        with ps.engine(folder, work, setting, free_memory=budget) as omni:
            cache = ps.newest_cache(stock=setting == "stock")
            free = cache.manager.block_pool.get_num_free_blocks()
            names = NAMES[:min(cache.session_capacity, n)]
            latents = ps.interleave(omni, src, names, TICKS)
            out[setting] = {
                "cache": cache, "names": names, "latents": latents,
                "held": {s: ps.held(cache, s) for s in names},
                "pages_taken": free - cache.manager.block_pool.get_num_free_blocks(),
                "open": tuple(cache._adapters), "uncapped": ps.admission(cache).capacity,
                "page_bytes": cache.spec.page_size_bytes * cache.num_layers}
    return out


def test_int2_admits_as_many_sessions_as_at_lingbot_worlds_geometry(runs):
    n, stock, int2 = runs["n"], runs["stock"], runs["int2"]
    assert n >= 2.5 * runs["stock_n"]
    assert stock["cache"].session_capacity == runs["stock_n"]  # LingBot's declared cap
    assert int2["cache"].session_capacity == int2["uncapped"] == n
    assert int2["cache"].memory_budget_bytes == runs["budget"]
    adm = int2["cache"].admission  # exactly n: one more session would not fit
    assert adm.fixed_bytes + n * adm.session_bytes <= runs["budget"] < adm.fixed_bytes + (n + 1) * adm.session_bytes
    # the tiny geometry's own bytes: stock's admit fewer than int2's, not 2.5x fewer
    assert runs["stock_n"] <= stock["uncapped"] < n


def test_the_engine_holds_every_admitted_session_at_once(runs):
    for setting in ("stock", "int2"):
        run = runs[setting]
        want = tuple(f"ar::{s}::main" for s in run["names"])
        assert run["open"] == want, setting
        assert sorted(run["latents"]) == sorted((s, i) for s in run["names"] for i in range(TICKS))
        assert run["pages_taken"] == sum(h["pages"] for h in run["held"].values()), setting
    assert len(runs["int2"]["names"]) == runs["n"]
    assert runs["int2"]["cache"].sessions() == runs["int2"]["open"]


def test_each_session_equals_the_session_run_alone(runs):
    lat, solo = runs["int2"]["latents"], runs["solo"]
    for (s, i), x in lat.items():
        assert torch.equal(x, solo[(NAMES[0], i)]), (s, i)


def test_every_session_drifts_from_stock_within_the_codec(runs):
    """Stock's sessions equal each other; every int2 session's latents equal stock's until a
    packed group is read (the tick after the planner's first pack), then drift by at most 1% of
    their magnitude (the codec's error, random weights)."""
    stock = runs["stock"]["latents"]
    for (s, i), x in stock.items():
        assert torch.equal(x, stock[(NAMES[0], i)]), (s, i)
    tiers = runs["int2"]["cache"].layout.tiers
    first = 1 + next(i for i, t in enumerate(tiers) if any(v != "bf16" for v in t.values()))
    ref = {(s, i): stock[(NAMES[0], i)] for s in runs["int2"]["names"] for i in range(TICKS)}
    _bounded_drift(ref, runs["int2"]["latents"], "int2", first, sessions=runs["int2"]["names"])


def test_bytes_per_session_measured_from_the_pool(runs):
    """Per session after the last tick: stock's pool holds sink + window frames; int2's the
    newest tick in the pool and the sink tick packed, at most 0.5 of stock's bytes, and, byte
    for byte, what the planner counts after that tick (what admission counts at most)."""
    page = runs["stock"]["page_bytes"]
    stock = runs["stock"]["held"]
    assert {h["pages"] for h in stock.values()} == {9}
    layout = runs["int2"]["cache"].layout
    frames, packed = layout.per_tick[TICKS - 1]
    for s, h in runs["int2"]["held"].items():
        assert (h["pages"], h["pool_bytes"], h["packed_bytes"]) == (frames, frames * page, packed), s
        assert h["pages"] == 3 and h["packed_groups"] == 1
        assert h["pool_bytes"] + h["packed_bytes"] <= 0.5 * stock[NAMES[0]]["pool_bytes"], (s, h)
