"""`causalkv memory` and its planner (`causalkv.memory`): the command line, the JSON,
the budget answer, the validation, and the planner's bytes against the real caches'."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from causalkv.caches import intervals as iv
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.spec import CausalCacheSpec
from causalkv.cli import main
from causalkv.errors import ConfigError
from causalkv.memory import (
    BUILTIN_MODELS,
    ROLLING_SLOT_CACHE,
    SETTINGS,
    STREAM_CACHE,
    MemoryRequest,
    ModelGeometry,
    check_budget,
    parse_bytes,
    plan_memory,
    plan_setting,
    positions,
    stream_layout,
)
from causalkv.memory.plan import _peak_at
from causalkv.runtime.model_io.geometry import read_model_geometry

LL2 = BUILTIN_MODELS["longlive2"]
NAMES = ["off", "int4-default", "int4-recent0", "int2-default", "int2-recent0", "int2-recent-int4",
         "int2-recent-fp8", "int2-sink0", "fp8-default", "fp8-recent0", "nvfp4-default",
         "nvfp4-recent0"]
#: the rows without the recency tier (an unmarked cache decides tiers at the advance: none)
BF16_TIER = [n for n in NAMES if n not in ("int2-recent-int4", "int2-recent-fp8")]

#: a tiny LongLive-2.0-like geometry: 2 layers x 2 heads x 64, 32 tokens per frame (32x64 px,
#: VAE 8, 1x1 patches), 2-frame chunks of 64 tokens, a 1-chunk sink, 4 chunk slots
TINY = ModelGeometry(
    "tiny", 2, 2, 64, vae_scale_spatial=8, vae_scale_temporal=4, patch=(1, 1),
    frames_per_chunk=2, sink_frames=2, global_sink_frames=2, window_frames=8, height=32,
    width=64, fps=16, default_frames=29, shot_sinks=True,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The caches here hold a few KiB: torch's intra-op threads only contend (on a loaded
    2-core machine the file ran 8x slower with them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["memory", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---- the command line ---------------------------------------------------------------------------
def test_table_longlive2_names_every_setting(capsys) -> None:
    code, out, err = run(capsys, "longlive2", "--frames", "61")
    assert code == 0 and err == ""
    assert "880 tokens per latent frame" in out and "2 chunks of 8 frames" in out
    rows = [line.split()[0] for line in out.splitlines() if line.split()[:1] and line.split()[0] in SETTINGS]
    assert rows == NAMES


def test_json_fields_and_dense_bytes(capsys) -> None:
    code, out, _ = run(capsys, "longlive2", "--frames", "61", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["setting"] for r in rows] == NAMES
    dense = 30 * 1 * 2 * 28_160 * 24 * 128 * 2  # layers x sets x (K,V) x window x H x D x bf16
    for r in rows:
        assert {"setting", "kv_bytes", "dense_bytes", "peak_bytes"} <= set(r)
        assert "fits" not in r
        assert r["dense_bytes"] == dense
        assert r["kv_bytes"] < r["peak_bytes"]
    with_cfg = json.loads(run(capsys, "longlive2", "--frames", "61", "--json", "--cfg")[1])
    for a, b in zip(rows, with_cfg):
        assert b["dense_bytes"] == 2 * a["dense_bytes"]
        assert b["kv_bytes"] == 2 * a["kv_bytes"]


def test_off_is_the_held_context() -> None:
    """Quant off at LongLive 2.0: 3 of the 4 slots hold context once the window is full (the
    denoising passes are probes: no layer holds the chunk being generated)."""
    plan = plan_memory(LL2, MemoryRequest(latent_frames=80), ROLLING_SLOT_CACHE, settings=["off"])
    r = plan.rows[0]
    token = 2 * 24 * 128 * 2  # K and V of one token, one layer
    assert r.chunk_bytes == 7_040 * token
    assert r.kv_bytes == 30 * 3 * 7_040 * token
    assert r.transient_bytes == 28_160 * token
    assert r.peak_bytes == r.kv_bytes + r.transient_bytes


def test_peak_ratio_targets_at_longlive2_geometry() -> None:
    """The model keeps the peak / dense ratios benchmarks/sglang_bridge.py --layers measured on
    the caches at this geometry (docs/benchmarks.md: 0.158, 0.189, 0.369, 0.252, 0.792; all
    layers, a shot pinned, the window full), each within its bound."""
    plan = plan_memory(LL2, MemoryRequest(latent_frames=80, shots=2), ROLLING_SLOT_CACHE)
    peak = {r.setting: r.peak_ratio for r in plan.rows}
    assert peak["int2-recent0"] <= 0.17
    assert peak["int2-recent-int4"] <= 0.19
    assert peak["int2-default"] <= 0.37
    assert peak["int4-recent0"] <= 0.26
    assert peak["off"] <= 0.80


def test_budget_answer_is_the_longest_window(capsys) -> None:
    code, out, _ = run(capsys, "longlive2", "--frames", "61", "--budget", "80GiB", "--json",
                       "--setting", "off", "--setting", "int2-default",
                       "--setting", "int2-recent-int4")
    assert code == 0
    rows = json.loads(out)
    budget = 80 * 2**30
    for r in rows:
        assert r["fits"] is (r["peak_bytes"] <= budget)
        w = r["max_window_frames"]
        assert w % 8 == 0
        memo: dict = {}
        setting = SETTINGS[r["setting"]]
        req = MemoryRequest(frames=61)
        assert _peak_at(LL2, req, ROLLING_SLOT_CACHE, setting, w, memo) <= budget
        assert _peak_at(LL2, req, ROLLING_SLOT_CACHE, setting, w + 8, memo) > budget
    table = run(capsys, "longlive2", "--frames", "61", "--budget", "80GiB", "--setting", "off")[1]
    assert "max_window_frames" in table and "fits" in table


def test_budget_answer_is_the_longest_video_for_self_forcing(capsys) -> None:
    rows = json.loads(run(capsys, "self-forcing", "--budget", "16GiB", "--json",
                          "--setting", "off", "--setting", "int2-recent0")[1])
    sf = BUILTIN_MODELS["self-forcing"]
    for r in rows:
        v = r["max_video_frames"]
        assert "max_window_frames" not in r and v % 3 == 0
        memo: dict = {}
        assert _peak_at(sf, MemoryRequest(), ROLLING_SLOT_CACHE, SETTINGS[r["setting"]], v, memo) <= 16 * 2**30
        assert _peak_at(sf, MemoryRequest(), ROLLING_SLOT_CACHE, SETTINGS[r["setting"]], v + 3, memo) > 16 * 2**30
    assert rows[1]["max_video_frames"] > 4 * rows[0]["max_video_frames"]


def test_nothing_fits_a_tiny_budget(capsys) -> None:
    rows = json.loads(run(capsys, "lingbot", "--budget", "1MiB", "--json")[1])
    assert all(r["fits"] is False and r["max_window_frames"] is None for r in rows)


def test_help_explains_every_column(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for column in ("setting", "kv_bytes", "peak_bytes", "dense_bytes", "fits",
                   "max_window_frames", "max_video_frames", *NAMES):
        assert f"  {column}" in text, column
    assert "sequence-parallel" in text.lower()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["longlive2", "--height", "700"], ["--height 700", "multiple of 32", "704"]),
        (["longlive2", "--frames", "62"], ["--frames 62", "--frames 61 or 65"]),
        (["longlive2", "--frames", "65"], ["17 latent frames", "--frames 61 or 93"]),
        (["longlive2", "--latent-frames", "12"], ["12 latent frames", "--latent-frames 8 or 16"]),
        (["longlive2", "--frames", "0"], ["--frames must be a positive int, got 0"]),
        (["longlive2", "--budget", "80XB"], ["--budget '80XB'", "80GiB"]),
        (["longlive2", "--budget", "0"], ["--budget '0'", "at least 1 byte"]),
        (["lingbot", "--shots", "2"], ["--shots 2", "no shot sinks", "--shots 1"]),
        (["longlive2", "--frames", "61", "--shots", "3"], ["--shots 3", "has 2 (16 latent frames", "fewer --shots"]),
        (["longlive2", "--window-frames", "12"], ["--window-frames 12", "--window-frames 16"]),
        (["longlive2", "--window-frames", "8"], ["--window-frames 8", "--window-frames 16"]),
        (["longlive2", "--batch-size", "0"], ["--batch-size must be a positive int, got 0"]),
        (["longlive2", "--seconds", "-1"], ["--seconds must be a finite number > 0, got -1.0"]),
        (["longlive2", "--seconds", "nan"], ["--seconds must be a finite number > 0, got nan"]),
        (["longlive2", "--seconds", "inf"], ["--seconds must be a finite number > 0, got inf"]),
        (["longlive2", "--fps", "30"], ["--fps 30", "pass --seconds or drop --fps"]),
        (["longlive2", "--seconds", "5", "--fps", "0"], ["--fps must be a positive int, got 0"]),
        (["longlive2", "--latent-frames", "10000000"],
         ["1,250,000 chunks", "pass --latent-frames 160000 (--frames 639997) or fewer"]),
        (["self-forcing", "--window-frames", "30000", "--latent-frames", "30000"],
         ["10,000 chunks with 10,000 chunk slots", "pass --latent-frames 4242"]),
        (["no-such-model"], ["unknown model 'no-such-model'", "longlive2, lingbot, self-forcing"]),
        (["longlive2", "--kv-cache-quant", "int3"],
         ["kv-cache-quant must be one of ['off', 'int4', 'int2', 'fp8', 'nvfp4'], got 'int3'"]),
        (["lingbot", "--host", "vllm-omni", "--kv-cache-quant", "int2"],
         ["--kv-cache-quant picks rows of --host sglang or causalkv", "(stock, off, int4, int2): drop --kv-cache-quant"]),
        (["lingbot", "--host", "vllm-omni", "--setting", "int2-default"], ["drop --setting"]),
    ],
)
def test_bad_input_is_one_line_naming_the_value_and_the_fix(capsys, argv, words) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("causalkv memory: error: ")
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize(
    "argv",
    [["longlive2", "--frames", "61", "--seconds", "3"], ["longlive2", "--setting", "int3"],
     ["longlive2", "--host", "vllm"], ["longlive2", "--height", "x"],
     ["longlive2", "--kv-cache-quant-sink", "2"]],
)
def test_bad_flags_are_usage_errors(capsys, argv) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["memory", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_seconds_round_up_to_whole_chunks() -> None:
    lay = stream_layout(LL2, MemoryRequest(seconds=10))  # 240 frames at 24 fps
    assert lay.latent_frames == 64 and lay.num_chunks == 8 and lay.video_frames >= 240
    lay = stream_layout(LL2, MemoryRequest(seconds=10, fps=16))  # 160 frames need 41 latent
    assert lay.latent_frames == 48 and lay.video_frames >= 160
    budget = plan_memory(LL2, MemoryRequest(seconds=10, fps=16), ROLLING_SLOT_CACHE, settings=["off"],
                         budget=parse_bytes("40GiB")).rows[0]
    assert budget.max_window_frames is not None and budget.max_window_frames > 32


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("1.5TiB") == int(1.5 * 2**40)
    assert parse_bytes("123") == 123
    with pytest.raises(ConfigError, match="is not a size"):
        parse_bytes("lots")


@pytest.mark.parametrize("budget", [None, 1, 2, 80 * 2**30])
def test_check_budget_takes_none_or_a_positive_int(budget) -> None:
    assert check_budget(budget) is budget


@pytest.mark.parametrize("budget", [0, -1, True, False, 1.0, 80.5 * 2**30, "80GiB"])
def test_check_budget_refuses_the_rest_naming_flag_value_and_example(budget) -> None:
    """What a positive byte count is not: zero, a negative int, a bool, a float, the text
    (`parse_bytes` reads it); the planner and vLLM-Omni's admission refuse each the same way."""
    from causalkv.vllm_omni.admission import plan_admission

    with pytest.raises(ConfigError) as got:
        check_budget(budget)
    assert str(got.value) == f"--budget must be a positive int, got {budget!r}; pass e.g. 80GiB"
    for plan in (lambda: plan_memory(LL2, MemoryRequest(), STREAM_CACHE, budget=budget),
                 lambda: plan_admission(budget)):
        with pytest.raises(ConfigError) as again:
            plan()
        assert str(again.value) == str(got.value)


def test_the_dtype_names_are_configs_and_their_bytes_are_torchs() -> None:
    """`DTYPE_BYTES` and `parse_dtype` take the names of `causalkv.config.DTYPES`, each with
    torch's own element size; `parse_dtype` refuses another naming them."""
    from causalkv.config import DTYPE_BYTES, DTYPES
    from causalkv.runtime.model_io.components import parse_dtype

    assert tuple(DTYPE_BYTES) == DTYPES == ("bfloat16", "float16", "float32")
    for name in DTYPES:
        assert parse_dtype(name) is getattr(torch, name)
        assert DTYPE_BYTES[name] == getattr(torch, name).itemsize
    with pytest.raises(ConfigError) as got:
        parse_dtype("int8")
    assert str(got.value) == "dtype must be one of ['bfloat16', 'float16', 'float32'], got 'int8'"


def test_frame_tokens_counts_the_whole_patches_of_a_latent_frame() -> None:
    """One token per whole ``p_h x p_w`` patch: counted by stepping the patches over every
    small frame; `ModelGeometry.tokens_per_frame` is it at the VAE's latent size."""
    from causalkv.memory import frame_tokens

    for h in range(0, 9):
        for w in range(0, 9):
            for patch in ((1, 1), (2, 2), (1, 2), (2, 1), (3, 2)):
                whole = len(range(patch[0], h + 1, patch[0])) * len(range(patch[1], w + 1, patch[1]))
                assert frame_tokens(h, w, patch) == whole == frame_tokens(h, w, list(patch))
    assert LL2.tokens_per_frame(704, 1280) == frame_tokens(704 // 16, 1280 // 16, (2, 2)) == 880


def test_decoded_frames_and_latent_frames_invert_each_other() -> None:
    """Wan's causal VAE: the first latent frame decodes to one video frame, each later one to
    ``s``; `ModelGeometry.latent_frames` is the inverse on the videos it makes, and every video
    length maps to the fewest latents whose decode covers it, counted frame by frame."""
    from causalkv.memory import decoded_frames

    for s in (1, 2, 4):
        for latent in range(1, 12):
            counted = 1 + sum(s for _ in range(latent - 1))
            assert decoded_frames(latent, s) == counted
    for latent in range(1, 12):
        assert LL2.latent_frames(LL2.video_frames(latent)) == latent
        assert LL2.video_frames(latent) == decoded_frames(latent, LL2.vae_scale_temporal)


def test_model_folders_are_read_by_their_config(tmp_path) -> None:
    """An sglang folder (native causal fields) and a diffusers one (causalkv.json)."""
    sg = tmp_path / "sg"
    (sg / "transformer").mkdir(parents=True)
    (sg / "vae").mkdir()
    (sg / "model_index.json").write_text(json.dumps({"_class_name": "LongLive2Pipeline"}))
    (sg / "transformer" / "config.json").write_text(json.dumps({
        "num_layers": 30, "num_attention_heads": 24, "attention_head_dim": 128,
        "patch_size": [1, 2, 2], "num_frames_per_block": 8, "sink_size": 8,
        "local_attn_size": 32, "sliding_window_num_frames": 32,
    }))
    (sg / "vae" / "config.json").write_text(json.dumps({"scale_factor_spatial": 16,
                                                         "scale_factor_temporal": 4}))
    g = read_model_geometry(sg)
    assert (g.num_layers, g.num_heads, g.head_dim, g.frames_per_chunk, g.sink_frames,
            g.window_frames, g.shot_sinks) == (30, 24, 128, 8, 8, 32, True)
    assert g.tokens_per_frame(704, 1280) == 880
    folder_rows = plan_memory(g, MemoryRequest(frames=61), ROLLING_SLOT_CACHE).as_json()
    builtin_rows = plan_memory(LL2, MemoryRequest(frames=61), ROLLING_SLOT_CACHE).as_json()
    assert [r["kv_bytes"] for r in folder_rows] == [r["kv_bytes"] for r in builtin_rows]

    df = tmp_path / "df"
    (df / "transformer").mkdir(parents=True)
    (df / "vae").mkdir()
    (df / "model_index.json").write_text(json.dumps({"_class_name": "SelfForcingWanPipeline"}))
    (df / "transformer" / "config.json").write_text(json.dumps({
        "num_layers": 30, "num_attention_heads": 12, "attention_head_dim": 128,
        "patch_size": [1, 2, 2]}))
    (df / "vae" / "config.json").write_text(json.dumps({"dim_mult": [1, 2, 4, 4],
                                                         "temperal_downsample": [False, True, True]}))
    (df / "causalkv.json").write_text(json.dumps({"window_frames": 12}))
    g = read_model_geometry(df)
    assert (g.frames_per_chunk, g.sink_frames, g.window_frames) == (3, 0, 12)
    assert g.tokens_per_frame(480, 832) == 1560 and g.window_is_video and not g.shot_sinks

    (df / "transformer" / "config.json").write_text(json.dumps({"num_layers": 30}))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        read_model_geometry(df)
    (df / "transformer" / "config.json").write_text(json.dumps({
        "num_layers": 0, "num_attention_heads": 12, "attention_head_dim": 128}))
    with pytest.raises(ConfigError, match="num_layers must be a positive int, got 0"):
        read_model_geometry(df)


@pytest.mark.parametrize(("stage", "shots"), [("causalkv.stages.longlive2:LongLive2Stage", True),
                                           ("causalkv.stages.wan:WanCausalDMDStage", False)])
def test_shot_sinks_are_what_the_serving_stage_declares(tmp_path, stage: str, shots: bool) -> None:
    """A folder is read as the runtime reads it, and whether a scene cut pins a shot sink is
    the registered stage's declaration (multi-shot generation), not a pipeline class name: a
    plugin's stage serving a new class gives its folders shot sinks when the stage has them."""
    from causalkv.hooks import StageRegistration
    from causalkv.plugin import get_plugin_manager
    from causalkv.plugin.testing import RecordsPlugin, temporary_plugin

    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "MyShotsPipeline"}))
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({
        "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 64}))
    reg = StageRegistration("my-shots", stage, models=("MyShotsPipeline",),
                            defaults={"frames_per_chunk": 2, "sink_frames": 2, "window_frames": 8})
    with temporary_plugin(get_plugin_manager(), RecordsPlugin(stages=[reg])):
        g = read_model_geometry(tmp_path)
    assert (g.frames_per_chunk, g.sink_frames, g.window_frames, g.shot_sinks) == (2, 2, 8, shots)
    # served by no stage and no causalkv.json: nothing says how it streams
    with pytest.raises(ConfigError, match="no registered stage serves pipeline 'MyShotsPipeline'"):
        read_model_geometry(tmp_path)


# ---- the planner against the real caches ------------------------------------------------------
def _kv(n: int, heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, n, heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(1, n, heads, dim, generator=g).to(torch.bfloat16)
    return k, v


def _tiny_spec(lay) -> CausalCacheSpec:
    return CausalCacheSpec(
        batch_size=1, num_heads=TINY.num_heads, head_dim=TINY.head_dim,
        cache_size=lay.cache_tokens, sink_tokens=lay.sink_tokens,
        global_sink_tokens=lay.global_sink_tokens, attention_window_size=lay.cache_tokens,
        dtype=torch.bfloat16,
    )


@pytest.mark.parametrize("sink", [True, False])
def test_positions_and_tiers_equal_the_unmarked_cache(sink: bool) -> None:
    """A cache whose writes are unmarked holds the chunk being generated itself and decides the tiers at
    the next advance: after chunk i+1's first write it holds what the planner says one layer
    holds after chunk i's context pass, plus chunk i+1 in bf16 (own host, 8 chunks, a shot
    pinned at chunk 4, every setting without the recent tier)."""
    req = MemoryRequest(latent_frames=16, shots=2, sink=sink)
    lay = stream_layout(TINY, req)
    assert lay.num_chunks == 8 and lay.pins == {4} and lay.chunk_tokens == 64
    states = positions(lay, STREAM_CACHE.positions)
    n, token = lay.chunk_tokens, 2 * TINY.num_heads * TINY.head_dim * 2
    for name in BF16_TIER:
        plan = plan_setting(TINY, lay, SETTINGS[name], cache=STREAM_CACHE, sink=sink, states=states)
        q = SETTINGS[name].quant_args(sink=sink)
        cache = QVGPackedCausalKVCache(_tiny_spec(lay), q if q.enabled else None)
        measured = []
        for i in range(lay.num_chunks + 1):
            k, v = _kv(n, TINY.num_heads, TINY.head_dim, seed=i)
            cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
            if i:  # chunk i-1's context as the next chunk's advance left it
                held = cache.state.retained
                assert held[-1][1] == (i + 1) * n
                assert iv.subtract(held, ((i * n, (i + 1) * n),)) == states[i - 1].held
                measured.append(cache.resident_nbytes() - n * token)
            if i in lay.pins:
                cache.pin_current_chunk(n)
        assert tuple(measured) == plan.resident_per_chunk, name
        assert cache.quantize_calls == sum(
            1 for c in range(lay.num_chunks) if any(t.get(c, "bf16") != "bf16" for t in plan.tiers_per_chunk)
        ), name


def test_request_fields_reach_the_bytes() -> None:
    base = plan_memory(TINY, MemoryRequest(latent_frames=16), ROLLING_SLOT_CACHE, settings=["off"]).rows[0]
    b2 = plan_memory(TINY, MemoryRequest(latent_frames=16, batch_size=2), ROLLING_SLOT_CACHE, settings=["off"]).rows[0]
    f32 = plan_memory(TINY, MemoryRequest(latent_frames=16, dtype="float32"), ROLLING_SLOT_CACHE, settings=["off"]).rows[0]
    assert b2.kv_bytes == 2 * base.kv_bytes and f32.kv_bytes == 2 * base.kv_bytes
    wide = plan_memory(TINY, replace(MemoryRequest(latent_frames=16), window_frames=12), ROLLING_SLOT_CACHE,
                       settings=["off"]).rows[0]
    assert wide.dense_bytes == base.dense_bytes * 12 // 8


# ---- the planner against the caches, probes and commits marked -------------------------------
def _drive_marked(lay, make_cache, layers: int, attention: str = "gathered"):
    """Drive ``layers x sets`` caches sharing one `PassMarker` through ``lay``'s stream: per
    chunk a denoising pass (a probe), then the context pass (the commit, ``pin`` announced for
    a cut chunk), then the pin; every view read as attention reads it (``gathered``: its
    ``k``/``v``, one buffer; ``streamed``: its segments one at a time). Returns per chunk the
    caches' resident bytes after the commit, and the marker's ledger peak."""
    from causalkv.caches.passes import PassMarker

    marker = PassMarker()
    caches = [make_cache(marker) for _ in range(layers * lay.sets)]
    n = lay.chunk_tokens
    resident = []
    for i in range(lay.num_chunks):
        for p in range(2):
            k, v = _kv(n, TINY.num_heads, TINY.head_dim, seed=10 * i + p)
            with marker.committing(pin=i in lay.pins) if p else marker.probing():
                for c in caches:
                    view = c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
                    if attention == "gathered":
                        assert view.k.shape == view.v.shape
                    else:
                        assert sum(sk.shape[1] for sk, _ in view.iter_segments()) > 0
        if i in lay.pins:
            for c in caches:
                c.pin_current_chunk(n)
        resident.append(sum(c.resident_nbytes() for c in caches))
    return resident, marker.ledger.peak_nbytes


@pytest.mark.parametrize(("name", "cfg"), [*((n, False) for n in NAMES), ("int2-recent-int4", True)])
def test_planner_equals_the_own_hosts_caches_marked(name: str, cfg: bool) -> None:
    """The exactness test: ``causalkv memory --host causalkv`` equals the bytes the real
    `QVGPackedCausalKVCache` s hold, 2 layers (x 2 CFG sets) sharing one marker, 8 chunks of
    64 tokens in 4 slots, a shot pinned at chunk 4: per chunk the caches' resident bytes,
    ``kv_bytes`` (their most) and ``peak_bytes`` (the marker's ledger)."""
    req = MemoryRequest(latent_frames=16, shots=2, cfg=cfg)
    lay = stream_layout(TINY, req)
    plan = plan_setting(TINY, lay, SETTINGS[name], cache=STREAM_CACHE, attention="gathered")
    q = SETTINGS[name].quant_args()
    spec = _tiny_spec(lay)
    resident, peak = _drive_marked(
        lay, lambda m: QVGPackedCausalKVCache(spec, q, marker=m), TINY.num_layers)
    per_layer = TINY.num_layers * lay.sets
    assert resident == [per_layer * r for r in plan.resident_per_chunk]
    assert max(resident) == plan.kv_bytes
    assert peak == plan.peak_bytes


@pytest.mark.parametrize(("name", "cfg"), [("off", False), ("int4-recent0", False),
                                           ("int2-default", False), ("int2-recent-int4", True)])
def test_planner_equals_the_own_hosts_caches_read_by_streaming_attention(name: str, cfg: bool) -> None:
    """causalkv generate's attention (`attend`) decodes one packed segment at a time: the
    ledger's peak is the caches plus the largest one-call buffer (a probe's window, a segment
    decoded), and the
    planner's ``--attention streamed`` (the causalkv host's default) says the same."""
    lay = stream_layout(TINY, MemoryRequest(latent_frames=16, shots=2, cfg=cfg))
    plan = plan_setting(TINY, lay, SETTINGS[name], cache=STREAM_CACHE)
    q = SETTINGS[name].quant_args()
    spec = _tiny_spec(lay)
    resident, peak = _drive_marked(
        lay, lambda m: QVGPackedCausalKVCache(spec, q, marker=m), TINY.num_layers, "streamed")
    assert resident == [TINY.num_layers * lay.sets * r for r in plan.resident_per_chunk]
    assert peak == plan.peak_bytes
    gathered = plan_setting(TINY, lay, SETTINGS[name], cache=STREAM_CACHE, attention="gathered")
    assert peak < gathered.peak_bytes if name != "off" else peak == gathered.peak_bytes


#: a sink that is not a whole number of chunks (3 frames of 2-frame chunks) whose global part
#: is 1 frame: after a pin, chunk 1 is held in part, and a packed part is kept whole
UNALIGNED = replace(TINY, name="tiny-unaligned", sink_frames=3, global_sink_frames=1, window_frames=10)


@pytest.mark.parametrize(("name", "sink"), [("int2-recent-int4", False), ("int4-default", False),
                                            ("int2-recent0", False), ("int2-default", True)])
def test_planner_equals_the_own_hosts_caches_at_an_unaligned_sink(name: str, sink: bool) -> None:
    lay = stream_layout(UNALIGNED, MemoryRequest(latent_frames=16, shots=2, sink=sink))
    plan = plan_setting(UNALIGNED, lay, SETTINGS[name], cache=STREAM_CACHE, sink=sink,
                        attention="gathered")
    q = SETTINGS[name].quant_args(sink=sink)
    spec = _tiny_spec(lay)
    resident, peak = _drive_marked(
        lay, lambda m: QVGPackedCausalKVCache(spec, q, marker=m), UNALIGNED.num_layers)
    assert resident == [UNALIGNED.num_layers * r for r in plan.resident_per_chunk]
    assert peak == plan.peak_bytes


#: a sink of two chunks (its whole span packed at once with sink_span="full")
SINK2 = replace(TINY, name="tiny-sink2", sink_frames=4, global_sink_frames=4, window_frames=12)

#: settings the table does not name, each down another path of the store's tier policy (the
#: geometry, and the settings without that path): spans of two chunks sharing a codebook over
#: four; the stream-start sink packed as one span; a recency tier with a codec of its own over
#: shared codebooks; a recency tier that is the cache's own codec (packed once, never re-packed)
#: holding the sinks bf16 would
TIER_PATHS = {
    "span2-book4": (QVGKVQuantArgs(codec="int2", span_chunks=2, codebook_chunks=4), TINY,
                    {"span_chunks": 1, "codebook_chunks": 1}),
    "sink-full": (QVGKVQuantArgs(codec="int4", sink_span="full"), SINK2, {"sink_span": "chunk"}),
    "recent-fp8-book2": (QVGKVQuantArgs(codec="int2", recent_tier="fp8", codebook_chunks=2), TINY,
                         {"recent_tier": "bf16", "codebook_chunks": 1}),
    "recent-int2-sink0": (QVGKVQuantArgs(codec="int2", recent_tier="int2", sink=False), TINY,
                          {"recent_tier": "bf16"}),
}


@pytest.mark.parametrize("name", list(TIER_PATHS))
def test_planner_and_store_share_one_tier_policy(name: str) -> None:
    """The planner has no tiering of its own: for settings beyond the table (spans, shared
    codebooks, a sink span, recency tiers) its bytes and its tiers equal the real caches' at
    every chunk, so a change to the store's tiering that the planner did not follow fails
    here (2 layers sharing a marker, 8 chunks, a shot pinned at chunk 4). Each setting's
    path changes the bytes (against the same settings without it), so each is exercised."""
    q, geom, plain = TIER_PATHS[name]
    lay = stream_layout(geom, MemoryRequest(latent_frames=16, shots=2))
    plan = plan_setting(geom, lay, SETTINGS["int2-default"], cache=STREAM_CACHE,
                        attention="gathered", quant=q)
    without = plan_setting(geom, lay, SETTINGS["int2-default"], cache=STREAM_CACHE,
                           attention="gathered", quant=replace(q, **plain))
    assert plan.resident_per_chunk != without.resident_per_chunk
    spec = _tiny_spec(lay)
    caches: list[QVGPackedCausalKVCache] = []

    def make(marker):
        caches.append(QVGPackedCausalKVCache(spec, q, marker=marker))
        return caches[-1]

    resident, peak = _drive_marked(lay, make, geom.num_layers)
    assert resident == [geom.num_layers * r for r in plan.resident_per_chunk]
    assert max(resident) == plan.kv_bytes
    assert peak == plan.peak_bytes
    held = {c: seg.storage.codec.name if seg.packed else "bf16"
            for seg in caches[0].store.segments for c in seg.chunks}
    assert held == plan.tiers_per_chunk[-1]


def test_a_causalkv_preset_is_a_model(capsys) -> None:
    """``causalkv generate``'s presets plan by their declaration (no files): tiny-longlive2-1k
    is 2 layers x 2 heads x 64, 256 tokens per frame, 4-frame chunks in a 24-frame window."""
    code, out, _ = run(capsys, "tiny-longlive2-1k", "--host", "causalkv", "--cfg",
                       "--latent-frames", "24", "--shots", "2", "--json")
    assert code == 0
    rows = {r["setting"]: r for r in json.loads(out)}
    token = 2 * 2 * 64 * 2
    assert rows["off"]["dense_bytes"] == 2 * 2 * 6_144 * token  # layers x sets x window x token
    assert rows["off"]["chunk_bytes"] == 1_024 * token
    # `causalkv generate --model tiny-longlive2-1k --prompt a --prompt b --frames 24
    # --kv-cache-quant int2 --metrics m.json` measured kv_resident_bytes_per_chunk [2097152,
    # 2457632, 2818112, 3178592, 3539072, 3539072] and kv_peak_bytes 4063360 (its denoising
    # passes are probes, storing nothing; its attention streams the window: one decoded
    # chunk, 512 KiB, on top)
    assert rows["int2-default"]["kv_bytes"] == 3_539_072
    assert rows["int2-default"]["peak_bytes"] == 4_063_360
    text = run(capsys, "tiny-longlive2-1k")[1]
    assert "note: off is the QVG cache with quantization off" in text


@pytest.mark.parametrize("attention", ["gathered", "streamed"])
@pytest.mark.parametrize("frames", [2, 4])
def test_planner_equals_the_own_hosts_caches_on_short_requests(attention: str, frames: int) -> None:
    """One and two chunks: the chunk alone is read as views (no buffer), and with nothing
    packed visible causalkv's cache builds the window when the view is made, before the move."""
    lay = stream_layout(TINY, MemoryRequest(latent_frames=frames, cfg=True))
    spec = _tiny_spec(lay)
    for name in ("int2-default", "int2-recent0"):
        plan = plan_setting(TINY, lay, SETTINGS[name], cache=STREAM_CACHE, attention=attention)
        q = SETTINGS[name].quant_args()
        resident, peak = _drive_marked(
            lay, lambda m, q=q: QVGPackedCausalKVCache(spec, q, marker=m), TINY.num_layers,
            attention)
        assert resident == [TINY.num_layers * 2 * r for r in plan.resident_per_chunk], name
        assert peak == plan.peak_bytes, name


def test_the_budget_search_says_where_it_stopped() -> None:
    from causalkv.cli.memory import format_plan

    plan = plan_memory(BUILTIN_MODELS["self-forcing"], MemoryRequest(), ROLLING_SLOT_CACHE, settings=["int2-recent0"],
                       budget=parse_bytes("1TiB"))
    (row,) = plan.as_json()
    assert row["fits"] and row["at_search_limit"] is True
    assert row["max_video_frames"] == 4242  # 1,414 chunks: 1,414^2 <= MAX_WORK
    assert ">= 4242" in format_plan(plan, "sglang")
