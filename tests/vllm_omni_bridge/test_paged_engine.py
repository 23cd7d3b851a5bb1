"""causalkv's pages through vLLM-Omni's own paged AR-diffusion engine on a CPU.

``Omni(..., engine_backend=ARDiffusionEngine)`` on the tiny LingBot-World checkpoint (random
weights; demo/vllm_omni/paged_sessions.py), two sessions interleaved, six ticks each, the same
seed, image, prompt and camera actions for both, once per setting: vLLM-Omni's own pool
(``stock``) and causalkv's pages at ``off``, ``int4`` and ``int2``. Stand-ins: the CPU ones
(demo/vllm_omni/cpu_stand_ins, with the platform's free memory for the engine's admission) and
the demo's tiny pipeline (the DiT built at the checkpoint's geometry).

The oracles: the stock engine's own output (off must equal it bit for bit: the same pages read
in the same order by the same kernel, the unread tick dropped); each codec's promised error
(`KVCodec.error_bound`) for every group packed at the store; the other session (same inputs:
sessions never mix); the stock pool's pages for the bytes per session.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

TICKS = 6
SESSIONS = ("a", "b")
#: the checkpoint's geometry (sink 3 + window 6 frames: the sink tick is packed, the newest
#: kept, the one between them is unread and dropped) and a wider one (sink 6 + window 9: every
#: tick leaving the newest is packed, read by the next one, then dropped)
GEOMETRIES = {"tiny": ((3, 9), ("stock", "off", "int4", "int2", "int2-routed")),
              "wide": ((6, 15), ("stock", "off", "int2", "int2-span2", "int2-fp8", "int2-routed"))}
#: ``int2-routed``: int2 with packed groups attended through `causalkv.caches.attend` (what runs
#: on CUDA), forced on the CPU (`forced_route`, attend's decode path)
#: the settings whose packs are checked (paged_sessions.NAMED: no keep-recent with 2-tick
#: spans; the newest tick at fp8, the recency tier)
PACKED = ("int4", "int2", "int2-span2", "int2-fp8")


def _folder(tmp_path_factory, name: str):
    from causalkv.runtime.tools.checkpoints import build_checkpoint

    work = tmp_path_factory.mktemp(f"paged-{name}")
    built = build_checkpoint("lingbot-world", work / "lingbot", host="vllm-omni")
    sink, window = GEOMETRIES[name][0]
    path = built / "transformer" / "config.json"
    config = json.loads(path.read_text())
    if (config["sink_size"], config["sliding_window_num_frames"]) != (sink, window):
        config.update(sink_size=sink, sliding_window_num_frames=window)  # no weight depends on them
        path.write_text(json.dumps(config))
    return built, work


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _folder(tmp_path_factory, "tiny")


@pytest.fixture(scope="module", params=list(GEOMETRIES))
def runs(request, tmp_path_factory):
    """Per setting: the latents by (session, tick), the session cache's report per session, the
    pool's pages per session, the planner's layout, and every group packed at the store (its
    input and its record)."""
    import paged_sessions as ps

    from causalkv.caches.attention import forced_route
    from causalkv.caches.qvg.store_pack import Packer
    from causalkv.vllm_omni.paged_cache import CausalKVPagedKVCache

    built, work = _folder(tmp_path_factory, request.param)
    SETTINGS = GEOMETRIES[request.param][1]
    packed: dict[str, list] = {}
    frames_read: dict[str, list[int]] = {}
    now = {"setting": ""}
    encode, view = Packer.encode, CausalKVPagedKVCache._forward_view

    def spy(self, step, pieces, book):
        seg, after = encode(self, step, pieces, book)
        k = torch.cat([p.storage.k for p in pieces], dim=1)
        v = torch.cat([p.storage.v for p in pieces], dim=1)
        packed.setdefault(now["setting"], []).append((k.clone(), v.clone(), seg))
        return seg, after

    def spy_view(self, inputs):
        fresh = self._view is None or self._view[0] is not inputs.block_table
        runs = view(self, inputs)
        if fresh:  # once per forward: the frames it reads
            bs = self.block_size
            frames_read.setdefault(now["setting"], []).append(
                sum(len(r[1]) if r[0] == "page" else (r[3] - r[2]) // bs for r in runs))
        return runs

    out = {}
    src = ps.image()
    mp = pytest.MonkeyPatch()
    mp.setattr(Packer, "encode", spy)  # the paged cache's packer
    mp.setattr(CausalKVPagedKVCache, "_forward_view", spy_view)
    try:
        for setting in SETTINGS:
            now["setting"] = setting
            routed = setting.endswith("-routed")
            record: list = []
            with ps.engine(built, work, setting.removesuffix("-routed")) as omni, \
                    forced_route(fused=False, record=record) if routed else contextlib.nullcontext():
                latents = ps.interleave(omni, src, SESSIONS, TICKS)
                cache = ps.newest_cache(stock=setting == "stock")
                pages = {s: ps.pool_pages(cache, s) for s in SESSIONS}
                reports = {} if setting == "stock" else {
                    s: cache.report(f"ar::{s}::main") for s in SESSIONS}
                out[setting] = {"latents": latents, "pages": pages, "reports": reports,
                                "page_bytes": cache.spec.page_size_bytes * cache.num_layers,
                                "capacity": cache.session_capacity, "type": type(cache).__name__,
                                "layout": getattr(cache, "layout", None),
                                "window": (cache.spec.sink_chunks, cache.spec.window_chunks),
                                "attended": record}
    finally:
        mp.undo()
    out["packed"] = packed
    out["frames_read"] = frames_read
    out["geometry"] = request.param
    return out


def _settings(runs):
    return [s for s in ("stock", "off", *PACKED) if s in runs]


def test_the_runner_built_causalkvs_cache_for_causalkvs_pipeline_only(runs):
    assert runs["stock"]["type"] == "ARDiffusionKVCache"
    for setting in _settings(runs)[1:]:
        assert runs[setting]["type"] == "CausalKVPagedKVCache"
        assert runs[setting]["window"] == runs["stock"]["window"] == {
            "tiny": (3, 6), "wide": (6, 9)}[runs["geometry"]]
    assert runs["stock"]["capacity"] == 2  # LingBot's declared cap
    assert runs["int2"]["capacity"] > 2  # causalkv's pipeline declares what fits


def test_off_is_bit_identical_to_the_stock_paged_engine(runs):
    for key, stock in runs["stock"]["latents"].items():
        assert torch.equal(runs["off"]["latents"][key], stock), key


def test_the_two_sessions_stay_equal(runs):
    for setting in _settings(runs):
        lat = runs[setting]["latents"]
        for i in range(TICKS):
            assert torch.equal(lat[("a", i)], lat[("b", i)]), (setting, i)


def _codecs(runs):
    return [c for c in PACKED if c in runs]


def _first_read(runs, setting) -> int:
    """The first tick that reads a packed group: the one after the first tick the planner packs
    something at (its per-tick tiers)."""
    tiers = runs[setting]["layout"].tiers
    return 1 + next(i for i, t in enumerate(tiers) if any(v != "bf16" for v in t.values()))


def test_every_forward_reads_what_the_stock_engine_reads(runs):
    """The frames each forward reads (sink, the newest held ticks, its own) are the same count
    for every setting as for off (bit-identical to stock): a packed span kept whole while its
    newer tick is held is not shown past what the cursor holds."""
    off = runs["frames_read"]["off"]
    assert len(off) == TICKS * len(SESSIONS) * 5
    for setting in _codecs(runs):
        assert runs["frames_read"][setting] == off, setting


def test_the_route_through_attend_changes_rounding_only(runs):
    """With packed groups attended through `causalkv.caches.attend` (the CUDA route, forced on
    the CPU) instead of the transient buffer, every tick before the first packed read is bit
    for bit int2's (the route engages only with packed groups visible), and every later one
    differs from int2's by less than a hundredth of int2's drift from off (rounding, not the
    codec); every layer call that read a packed group went through attend."""
    int2, routed, off = (runs[s]["latents"] for s in ("int2", "int2-routed", "off"))
    first = _first_read(runs, "int2")
    for (s, i), x in int2.items():
        diff = float((routed[(s, i)] - x).abs().max())
        if i < first:
            assert diff == 0.0, (s, i)
        else:
            assert diff <= 1e-2 * float((x - off[(s, i)]).abs().max()), (s, i, diff)
    reads = sum(runs["int2-routed"]["reports"][s].packed_reads for s in SESSIONS)
    assert reads == sum(runs["int2"]["reports"][s].packed_reads for s in SESSIONS) > 0
    stats = runs["int2-routed"]["attended"]
    assert len(stats) == reads and all(st.segments >= 2 and st.decoded_segments == 0 for st in stats)
    assert runs["int2"]["attended"] == []


def test_packed_groups_are_within_the_codecs_bound_at_the_store(runs):
    for codec in _codecs(runs):
        records = runs["packed"][codec]
        packs = sum(runs[codec]["reports"][s].packs for s in SESSIONS)
        assert len(records) == packs * 2  # every pack, in both layers
        _within_bound(records)


def _within_bound(records):
    for k, v, seg in records:
        dense = seg.storage.decoded(k.device, torch.float32)
        for x, got in ((k, dense.k), (v, dense.v)):
            bound = seg.storage.codec.error_bound(x.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
            err = (got.double() - x.double()).abs()
            assert bool((err <= bound * (1 + 1e-6) + 1e-6).all()), float((err - bound).max())
            assert float(err.max()) > 0  # really packed


def test_drift_at_the_output_is_bounded_and_starts_when_packed_groups_are_read(runs):
    for codec in _codecs(runs):
        _bounded_drift(runs["off"]["latents"], runs[codec]["latents"], codec, _first_read(runs, codec))


def _bounded_drift(off, lat, codec, first, sessions=SESSIONS):
    for i in range(TICKS):
        for s in sessions:
            drift = float((lat[(s, i)] - off[(s, i)]).abs().max())
            scale = float(off[(s, i)].abs().max())
            if i < first:  # nothing packed is read yet
                assert drift == 0.0, (codec, s, i)
            else:
                assert 0.0 < drift <= 1e-2 * scale, (codec, s, i, drift, scale)


def test_packed_groups_are_read_and_rolled_out(runs):
    """The packed records each session holds after the last tick are the ticks the planner
    packs there (the sink ticks and, with a wider window, the newer ticks it holds packed);
    every forward from the first one after a pack on reads a packed group."""
    for codec in _codecs(runs):
        last = runs[codec]["layout"].tiers[TICKS - 1]
        want = {f for g, t in last.items() if t != "bf16" for f in range(3 * g, 3 * g + 3)}
        for s in SESSIONS:
            rep = runs[codec]["reports"][s]
            assert {f for a, b in rep.packed_groups for f in range(a, b)} == want, (codec, rep)
            assert rep.packed_reads == (TICKS - _first_read(runs, codec)) * 5 * 2, (codec, rep)
        if (runs["geometry"], codec) == ("tiny", "int2"):
            assert runs[codec]["reports"]["a"].packed_groups == ((0, 3),)  # the sink tick
        if (runs["geometry"], codec) == ("wide", "int2"):  # sink ticks 0 and 1, and tick 4
            assert runs[codec]["reports"]["a"].packed_groups == ((0, 3), (3, 6), (12, 15))
            assert runs[codec]["reports"]["a"].packs == TICKS - 1  # ticks 2, 3 dropped since
        if codec == "int2-span2":  # ticks 4 and 5 as one span
            assert (12, 18) in runs[codec]["reports"]["a"].packed_groups
    assert runs["off"]["reports"]["a"].packed_reads == 0


def test_bytes_per_session_measured_from_the_pool_are_the_planners(runs):
    """Stock holds sink + window frames per session; off the frames the next tick reads (one
    tick fewer); int2 the newest tick in the pool and the rest packed: at most 0.5 of stock's,
    and, byte for byte, what the planner counts after the same tick (`causalkv_layout`), at
    most what admission counts."""
    page = runs["stock"]["page_bytes"]
    sink, total = GEOMETRIES[runs["geometry"]][0]
    assert runs["stock"]["pages"] == dict.fromkeys(SESSIONS, total)
    assert runs["off"]["pages"] == dict.fromkeys(SESSIONS, total - 3)
    stock = total * page
    for setting in _settings(runs)[1:]:
        layout = runs[setting]["layout"]
        for s in SESSIONS:
            rep = runs[setting]["reports"][s]
            frames, packed = layout.per_tick[TICKS - 1]  # the planner's, after the last tick
            assert rep.pages == runs[setting]["pages"][s] == frames
            assert rep.pool_bytes == frames * page
            assert rep.packed_bytes == packed
            assert frames <= layout.bf16_frames and packed <= layout.packed_bytes  # what is admitted
            if setting != "off":
                assert rep.nbytes <= 0.5 * stock, (setting, rep, stock)
    assert runs["int2"]["reports"]["a"].pages == 3  # the newest tick
    if "int2-fp8" in runs:  # the newest tick packed at the recency tier: no page held
        assert runs["int2-fp8"]["reports"]["a"].pages == 0


def test_closing_eviction_and_failure_drop_records(folder):
    """A tick that closes its session, an eviction (three sessions where two fit) and a failed
    forward each leave no record and give the pages back; the evicted session is told so by
    name on its next tick. vLLM-Omni's offline ``Omni`` shuts down after a failed request, so
    the refused tick comes last."""
    import paged_sessions as ps

    from causalkv.memory.records import SETTINGS as ROWS
    from causalkv.vllm_omni.admission import admit, causalkv_layout

    built, work = folder
    src = ps.image()
    with ps.engine(built, work, "int2") as omni:  # learn one session's bytes at this geometry
        probe = ps.newest_cache()
    adm = probe.admission
    two = adm.fixed_bytes + 2 * adm.session_bytes  # exactly two sessions fit
    assert admit(probe.geometry, causalkv_layout(probe.geometry, ROWS["int2-default"].quant_args()),
                 available_bytes=two, gpu_memory_fraction=1.0).capacity == 2
    with ps.engine(built, work, "int2", free_memory=two) as omni:
        cache = ps.newest_cache()
        assert cache.session_capacity == 2
        free = cache.manager.block_pool.get_num_free_blocks()
        for i in range(2):
            for s in ("a", "b"):
                ps.tick(omni, src, s, i)
        assert cache.sessions() == ("ar::a::main", "ar::b::main")
        assert cache.report("ar::b::main").packed_groups == ((0, 3),)
        held = {s: cache.report(f"ar::{s}::main").pages for s in ("a", "b")}
        assert free - cache.manager.block_pool.get_num_free_blocks() == held["a"] + held["b"]
        ps.tick(omni, src, "b", 2, close=True)  # closed: its pages and records go
        assert cache.sessions() == ("ar::a::main",)
        assert free - cache.manager.block_pool.get_num_free_blocks() == held["a"]
        ps.tick(omni, src, "c", 0)
        ps.tick(omni, src, "d", 0)  # full: 'a', the least recently used, is evicted
        assert cache.sessions() == ("ar::c::main", "ar::d::main")
        with pytest.raises(RuntimeError) as exc:
            ps.tick(omni, src, "a", 2)
    text = str(exc.value)
    assert "LingBot session 'a' was evicted" in text and "to admit session 'd'" in text
    assert "engine holds 2 session(s)" in text and "chunk_index 2 cannot continue it" in text
    assert "must be contiguous" not in text
    # the refused tick's session was opened (evicting 'c', as vLLM-Omni's runner makes room for
    # any new session id) and released when its forward failed: no record of it is left
    assert cache.sessions() == ("ar::d::main",)
    assert cache.manager.block_pool.get_num_free_blocks() == free - cache.report("ar::d::main").pages
