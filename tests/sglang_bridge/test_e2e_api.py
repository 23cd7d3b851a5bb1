"""sglang's Python API end to end: ``DiffGenerator.from_pretrained(...).generate(...)`` on the
tiny sglang-native checkpoints, causalkv's bridge discovered through its entry point in
sglang's spawned worker.

LongLive 2.0 (``LongLive2Pipeline``): one generator per mode (bridge off = stock sglang,
``--kv-cache-quant`` off, int2 with keep-recent 0), each serving the same two requests: two
shots (a scene cut, so a pin) without CFG, and the same with CFG (guidance 3, a negative
prompt: a second, negative cache set). Quant off through the bridge keeps sglang's own dense
cache, so its frames must equal stock sglang's bit for bit on the same seed; int2 must run on
causalkv's caches, pin the scene-cut chunk, hold fewer KV bytes than dense, stay finite and
hold exactly what ``causalkv memory`` plans for it. One generator per setting that matters:
int4 and int2 at keep-recent 1 run through ``sglang generate`` (test_e2e_cli.py) and the
realtime server (test_e2e_realtime.py), whose int4 row also holds more bytes than int2's.

Wan causal DMD (``WanCausalDMDPipeline``) cannot run in sglang 0.5.23 (see
`test_wan_causal_dmd_fails_inside_sglang_for_sglangs_own_reason`); the test pins the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
from e2e import planner_matches, serving_lines, summaries
from longlive2_request import GEOMETRY, SHOTS, fd_log, frames_of, free_ports, psnr

MODES = {
    "stock": ({"CAUSALKV_SGLANG_BRIDGE": "0"}, {"bits": 2}),
    "off": ({}, None),
    "int2-recent0": ({}, {"bits": 2, "keep_recent_chunks": 0}),
}
REQUESTS = {
    "shots": dict(SHOTS),
    "shots+cfg": dict(SHOTS, guidance_scale=3.0, negative_prompt="blurry, low quality"),
}


@pytest.fixture(scope="module")
def longlive2_runs(longlive2_checkpoint, tmp_path_factory):
    """{mode: (log, {request: frames})}: one DiffGenerator per mode, both requests each.

    The stock generator asks for int2 (as a dict, like every other mode here) with the
    bridge off: stock sglang keeps its dense cache for LongLive 2.0, which is what it shows.
    """
    import os

    from sglang.multimodal_gen import DiffGenerator

    logs = tmp_path_factory.mktemp("api-logs")
    runs = {}
    for mode, (env, quant) in MODES.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with fd_log(logs / f"{mode}.log") as read:
                kw = {} if quant is None else {"kv_cache_quant_config": quant}
                gen = DiffGenerator.from_pretrained(
                    model_path=str(longlive2_checkpoint), model_id="LongLive-2.0-5B",
                    num_gpus=1, **free_ports(), **kw)
                try:
                    frames = {}
                    for name, req in REQUESTS.items():
                        result = gen.generate(sampling_params_kwargs=dict(
                            GEOMETRY, save_output=False, return_frames=True, **req))
                        assert result is not None, f"{mode}/{name} failed:\n{read()[-3000:]}"
                        frames[name] = frames_of(result)
                finally:
                    gen.shutdown()
                runs[mode] = (read(), frames)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return runs


def test_quant_off_through_the_bridge_equals_stock_sglang_bit_for_bit(longlive2_runs):
    """With quant off the bridge keeps sglang's dense cache (its own cache would be bit-equal
    to it), so the decoded frames of both requests equal stock sglang's on the same seed."""
    stock_log, stock = longlive2_runs["stock"]
    off_log, off = longlive2_runs["off"]
    for name in REQUESTS:
        assert stock[name].shape == (GEOMETRY["num_frames"], 256, 256, 3)
        assert np.array_equal(off[name], stock[name]), name
    assert summaries(off_log) and {s["cache"] for s in summaries(off_log)} == {
        "CausalSelfAttentionKVCache"}
    assert any("kv-cache-quant off" in line for line in serving_lines(off_log))


def test_bridge_off_gives_stock_sglang_silent_dense_for_longlive2_with_a_warning(longlive2_runs):
    """Measured stock behaviour: LongLive 2.0 accepts int2 and keeps its dense bf16 cache
    (no refusal, no pinned-sink error); causalkv's observer says so in the worker's log."""
    log, _ = longlive2_runs["stock"]
    assert summaries(log) == [] and serving_lines(log) == []
    warnings = [line for line in log.splitlines() if "is not applied to" in line]
    assert len(warnings) == 1, log[-3000:]
    assert "LongLive2CausalDenoisingStage" in warnings[0]
    assert "CAUSALKV_SGLANG_BRIDGE=0" in warnings[0] and "unset CAUSALKV_SGLANG_BRIDGE" in warnings[0]


def test_int2_runs_on_causalkvs_caches_pins_and_holds_less_than_dense(longlive2_runs):
    log, frames = longlive2_runs["int2-recent0"]
    _, stock = longlive2_runs["stock"]
    lines = serving_lines(log)
    assert len(lines) == 1 and "SGLangQVGKVCache" in lines[0] and "int2" in lines[0]
    assert "keep-recent 0" in lines[0] and "sink chunks" in lines[0] and "served by causalkv" in lines[0]
    by_sets = {int(s["sets"]): s for s in summaries(log)}
    assert set(by_sets) == {1, 2}  # without CFG one cache set, with CFG the negative one too
    for s in by_sets.values():
        assert s["cache"] == "SGLangQVGKVCache"
        assert int(s["resident_bytes"]) < int(s["dense_bytes"])
        assert int(s["packed_chunks"]) >= 1
        assert int(s["pinned_tokens"]) > 0  # the second shot's scene-cut chunk
    for name in REQUESTS:
        f = frames[name]
        assert f.shape == stock[name].shape and f.dtype == np.uint8
        assert not np.array_equal(f, stock[name])  # packing changed the attended K/V
        print(f"int2-recent0 {name}: PSNR vs stock {psnr(f, stock[name]):.2f} dB, "
              f"resident {by_sets[1]['resident_bytes']} of {by_sets[1]['dense_bytes']} B")


def test_causalkv_memory_equals_the_int2_recent0_summary(longlive2_runs, longlive2_checkpoint):
    """`causalkv memory` on the folder, for the two-shot request without CFG (one cache set),
    gives this generator's logged peak, resident and dense bytes to the byte (int2 at sglang's
    defaults is test_e2e_cli's)."""
    log, _ = longlive2_runs["int2-recent0"]
    one_set = "\n".join(line for line in log.splitlines()
                        if "causalkv kv-cache summary:" not in line or " sets=1 " in f"{line} ")
    planner_matches(longlive2_checkpoint, one_set, "int2-recent0")


def test_wan_causal_dmd_fails_inside_sglang_for_sglangs_own_reason(wan_causal_checkpoint, tmp_path):
    """sglang 0.5.23's Wan causal DMD path cannot run (any device): its causal block passes
    ``crossattn_cache=`` to ``WanT2VCrossAttention``, which takes no such argument. Given the
    Self-Forcing config in Python (no registered model resolves to it), everything before the
    DiT's cross-attention runs: the native checkpoint loads, and the bridge serves the stage
    (its allocation line is in the worker's log)."""
    from sglang.multimodal_gen import DiffGenerator
    from sglang.multimodal_gen.configs.pipeline_configs.wan import SelfForcingWanT2V480PConfig

    with fd_log(tmp_path / "wan.log") as read:
        gen = DiffGenerator.from_pretrained(
            model_path=str(wan_causal_checkpoint), model_id="Wan2.1-T2V-1.3B-Diffusers",
            pipeline_config=SelfForcingWanT2V480PConfig(), num_gpus=1,
            kv_cache_quant_config={"bits": 2}, **free_ports())
        try:
            result = gen.generate(sampling_params_kwargs=dict(
                GEOMETRY, prompt=SHOTS["shot_prompts"][0], save_output=False, return_frames=True))
        finally:
            gen.shutdown()
        log = read()
    assert result is None
    assert "Loaded transformer: CausalWanTransformer3DModel" in log
    assert any("CausalDMDDenoisingStage KV cache" in line and "SGLangQVGKVCache" in line
               for line in serving_lines(log)), log[-3000:]
    assert "WanT2VCrossAttention.forward() got an unexpected keyword argument 'crossattn_cache'" in log


def test_lingbot_world_runs_with_camera_actions_on_either_codec(lingbot_checkpoint, tmp_path,
                                                                monkeypatch):
    """LingBot-World (image to video, camera actions) through the bridge at int2, once with
    causalkv's codec (the default) and once with ``CAUSALKV_SGLANG_LINGBOT_QVG=sglang``
    (sglang's own QVG cache): each allocation line names its codec. Offline, sglang's LingBot
    pipeline denoises one chunk per request (multi-chunk streams need a realtime session): its
    denoising passes attend to bf16 K/V on either cache, so the videos are equal bit for bit.
    On causalkv's cache that chunk (the 3-frame sink) then goes straight to its tier in its own
    context pass (sglang's rule packs a completed sink chunk at once): 1 chunk packed; sglang's
    own cache packs at the next advance, which never comes: 0 (a realtime stream that packs
    and rolls: test_e2e_realtime.py)."""
    from PIL import Image
    from sglang.multimodal_gen import DiffGenerator

    image = tmp_path / "first-frame.png"
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((128, 128, 3)) * 255).astype(np.uint8)).save(image)
    # one 3-latent-frame chunk (9 video frames) at 128x128: 256 tokens per latent frame
    request = dict(GEOMETRY, height=128, width=128, num_frames=9, prompt=SHOTS["shot_prompts"][0],
                   image_path=str(image), actions=[["w"], ["w", "j"], ["w"], ["l"], ["w"]],
                   save_output=False, return_frames=True)
    runs = {}
    for codec in ("causalkv", "sglang"):
        monkeypatch.setenv("CAUSALKV_SGLANG_LINGBOT_QVG", codec)
        with fd_log(tmp_path / f"{codec}.log") as read:
            gen = DiffGenerator.from_pretrained(
                model_path=str(lingbot_checkpoint), model_id="lingbot-world-fast-diffusers",
                num_gpus=1, kv_cache_quant_config={"bits": 2}, **free_ports())
            try:
                result = gen.generate(sampling_params_kwargs=dict(request))
            finally:
                gen.shutdown()
            log = read()
        assert result is not None, log[-3000:]
        runs[codec] = (log, frames_of(result))
    for codec, cache, packed in (("causalkv", "SGLangQVGKVCache", "1"),
                                 ("sglang", "QVGPackedCausalKVCache", "0")):
        log, frames = runs[codec]
        (line,) = serving_lines(log)
        assert "LingBotWorldCausalDMDDenoisingStage KV cache" in line
        assert f"{cache} x 2 blocks, served by {codec}" in line
        (s,) = summaries(log)
        assert s["cache"] == cache and s["packed_chunks"] == packed
        assert frames.shape == (9, 128, 128, 3)
    assert np.array_equal(runs["causalkv"][1], runs["sglang"][1])
