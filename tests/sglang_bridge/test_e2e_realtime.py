"""LingBot-World end to end through sglang's own realtime entry point: ``sglang serve`` on the
loopback interface and its ``/v1/realtime_video/generate`` websocket, streaming several chunks
of one session (sglang's offline LingBot pipeline denoises one chunk per request; only a
realtime session keeps the KV caches across chunks, so only there do chunks complete, pack and
roll out of the window).

One server per mode, each serving one session of `CHUNKS` chunks on the tiny LingBot-World
checkpoint (1x1 patches, 256 tokens per latent frame at 128x128, 3-frame chunks of 768
tokens, a 3-frame sink and a 12-frame cache: the sink and three chunks), with the
checkpoint's first frame and camera actions as sglang's realtime LingBot adapter takes them:

- ``stock``: the bridge off (``CAUSALKV_SGLANG_BRIDGE=0``), quant off: sglang as released;
- ``off``: the bridge on, ``--kv-cache-quant off``: must equal stock bit for bit;
- ``int4``, ``int2``: causalkv's caches and codec;
- ``sglang-codec``: int2 with ``CAUSALKV_SGLANG_LINGBOT_QVG=sglang`` (sglang's own
  ``QVGPackedCausalKVCache``), whose codec is quant-videogen's: not in this environment, so
  sglang refuses at its first pack, mid-stream.

The worker logs the bridge's summary line once per chunk, over the session's caches; the test
environment's probe (`realtime_probe`) prints the same fields plus the stream's cursors from
outside, for stock sglang too (where the bridge is off and says nothing). Servers start one ahead of the session that
needs them (at most two alive), so a start overlaps the previous session.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
from e2e import (
    REALTIME_SIZE,
    RealtimeServer,
    probe_records,
    realtime_init,
    realtime_stream,
    serving_lines,
    summaries,
)
from longlive2_request import psnr

#: chunks per session. Oracle (sglang's packing rule, which the bridge keeps): a 12-frame cache
#: holds the sink chunk plus three 3-frame chunks; with keep-recent 1 a completed non-sink
#: chunk packs once a newer completed one exists, the sink (sink packing on, sglang's
#: default) packs once the first non-sink chunk is written. Chunk 1 packs the sink, chunk 3
#: packs chunk 1, chunk 4 overflows the window (tokens 3,840 > 3,072): chunk 1 is evicted and
#: chunk 2 packs. So after chunk 4: 3 chunks packed in all, 2 held packed (sink, chunk 2),
#: chunks 3 and 4 bf16.
CHUNKS = 5
CHUNK_TOKENS = 3 * 256
CACHE_TOKENS = 12 * 256
MODEL_ID = "lingbot-world-fast-diffusers"
_BRIDGE_ENV = ("CAUSALKV_SGLANG_BRIDGE", "CAUSALKV_SGLANG_LINGBOT_QVG", "CAUSALKV_TEST_REALTIME_PROBE")
MODES = {
    "stock": ({"CAUSALKV_SGLANG_BRIDGE": "0"}, ("--kv-cache-quant", "off")),
    "off": ({}, ("--kv-cache-quant", "off")),
    "int4": ({}, ("--kv-cache-quant", "int4")),
    "int2": ({}, ("--kv-cache-quant", "int2")),
    "sglang-codec": ({"CAUSALKV_SGLANG_LINGBOT_QVG": "sglang"}, ("--kv-cache-quant", "int2")),
}
H, W = REALTIME_SIZE
#: servers started ahead of the session in progress: a start is mostly one core of Python
#: imports (~16 s here), a session ~5 s on both, so two starting at once keep both cores busy
#: (at most three servers alive, ~2 GB each)
AHEAD = 2
#: what sglang's worker logs when a session's caches are released
RELEASED = "Realtime session release: session_id="
#: the first chunk decodes to 1 + 4 * 2 video frames, every later one to 4 * 3
FRAMES = [9] + [12] * (CHUNKS - 1)


@pytest.fixture(scope="module")
def realtime_runs(lingbot_checkpoint, tmp_path_factory):
    """{mode: (worker log, stream)}; the ``off`` server also serves a one-chunk session
    without camera actions (``"off/no-actions"``)."""
    root = tmp_path_factory.mktemp("realtime")
    servers = {}
    for mode, (env, flags) in MODES.items():
        env = {**dict.fromkeys(_BRIDGE_ENV), **env, "CAUSALKV_TEST_REALTIME_PROBE": "1"}
        servers[mode] = RealtimeServer(lingbot_checkpoint, root / mode, *flags,
                                       model_id=MODEL_ID, env=env)
    order = list(servers)
    runs = {}
    try:
        for mode in order[:AHEAD]:
            servers[mode].start()
        for i, mode in enumerate(order):
            server = servers[mode]
            port = server.wait_ready()
            if i + AHEAD < len(order):
                servers[order[i + AHEAD]].start()  # its start-up overlaps this session
            stream = realtime_stream(port, realtime_init(lingbot_checkpoint, max_chunks=CHUNKS))
            server.wait_for(RELEASED)
            extra = None
            if mode == "off":
                extra = realtime_stream(port, realtime_init(lingbot_checkpoint, max_chunks=1,
                                                            actions=False))
                server.wait_for(RELEASED, 2)
            server.stop()  # the worker's log is complete once it exits
            runs[mode] = (server.log(), stream)
            if extra is not None:
                runs["off/no-actions"] = (runs[mode][0], extra)
    finally:
        for server in servers.values():
            server.stop()
    return runs


def _complete(log: str, stream) -> None:
    assert stream.errors == [], (stream.errors, log[-3000:])
    assert stream.closed == "1000 generation complete", (stream.closed, log[-3000:])
    assert [c.shape for c in stream.chunks] == [(n, H, W, 3) for n in FRAMES]
    assert [s["chunk_index"] for s in stream.stats] == list(range(CHUNKS))


def test_quant_off_through_the_bridge_equals_stock_sglang_bit_for_bit(realtime_runs):
    """With quant off the bridge keeps sglang's dense cache (its own would be bit-equal), so
    every chunk of the stream equals stock sglang's on the same seed, first frame and camera
    actions; both run on sglang's dense cache, which the session keeps across chunks."""
    stock_log, stock = realtime_runs["stock"]
    off_log, off = realtime_runs["off"]
    _complete(stock_log, stock)
    _complete(off_log, off)
    for i, (a, b) in enumerate(zip(off.chunks, stock.chunks, strict=True)):
        assert np.array_equal(a, b), f"chunk {i}"
    assert stock.frames.std() > 0
    assert serving_lines(stock_log) == [] and summaries(stock_log) == []
    (line,) = serving_lines(off_log)
    assert "LingBotWorldCausalDMDDenoisingStage keeps sglang's dense KV cache" in line
    assert "(kv-cache-quant off)" in line
    for log in (stock_log, off_log):
        records = probe_records(log)[:CHUNKS]  # off's log also has the no-actions session
        assert [int(r["chunk"]) for r in records] == list(range(CHUNKS))
        assert {r["persist"] for r in records} == {"1"}  # the session's caches, kept
        assert {r["cache"] for r in records} == {"CausalSelfAttentionKVCache"}
        assert all(r["resident_bytes"] == r["dense_bytes"] for r in records)
        assert int(records[-1]["tokens_written"]) == CHUNKS * CHUNK_TOKENS


def test_first_frame_and_camera_actions_reach_the_stream(realtime_runs, lingbot_checkpoint):
    """The first frame (PNG bytes in ``init``) is what sglang's worker conditions on, and the
    camera script in ``condition_inputs`` (``camera_actions.json``'s per-frame keys) conditions
    the stream: the same session without it gives another first chunk. The second session on
    the same server also starts from fresh caches (sglang released the first)."""
    log, with_actions = realtime_runs["off"]
    saved = set(re.findall(r"image_path: (\S+)", log))  # one upload per session
    assert len(saved) == 2
    for path in saved:
        assert Path(path).read_bytes() == (lingbot_checkpoint / "first_frame.png").read_bytes()
    _, without = realtime_runs["off/no-actions"]
    assert without.errors == [] and [c.shape for c in without.chunks] == [(FRAMES[0], H, W, 3)]
    assert not np.array_equal(without.chunks[0], with_actions.chunks[0])
    assert log.count(RELEASED) == 2
    records = probe_records(log)
    assert [int(r["chunk"]) for r in records] == [*range(CHUNKS), 0]
    assert int(records[-1]["tokens_written"]) == CHUNK_TOKENS


@pytest.mark.parametrize("mode", ["int4", "int2"])
def test_quant_streams_on_causalkvs_caches_packs_and_rolls(realtime_runs, mode):
    log, stream = realtime_runs[mode]
    _, off = realtime_runs["off"]
    _complete(log, stream)
    (line,) = serving_lines(log)  # allocated once, on chunk 0, for the whole session
    assert "LingBotWorldCausalDMDDenoisingStage KV cache causalkv.sglang.cache.SGLangQVGKVCache" in line
    assert f"x 2 blocks, served by causalkv, qvg(int{mode[-1]}," in line and "keep-recent 1" in line
    # the bridge's own summary line, one per chunk (each realtime chunk is a request), covers
    # the session's caches: what the probe reads from outside, the worker's log states itself
    records = probe_records(log)
    lines = summaries(log)
    assert len(lines) == CHUNKS
    for line, record in zip(lines, records, strict=True):
        for key in ("cache", "packed_chunks", "resident_bytes", "dense_bytes"):
            assert line[key] == record[key], key
    assert [int(r["chunk"]) for r in records] == list(range(CHUNKS))
    assert {r["cache"] for r in records} == {"SGLangQVGKVCache"} and {r["persist"] for r in records} == {"1"}
    # each chunk goes to its tier in its own context pass (the commit; its denoising passes
    # are probes, storing nothing): the sink
    # chunk packed at once (sglang's rule), the newest non-sink chunk bf16 (keep-recent 1) until
    # the next one's context pass packs it; the 4-slot cache keeps 3 chunks of context (the
    # next chunk's advance evicts the oldest non-sink one, dropped at the context pass already)
    assert [int(r["quantize_calls"]) for r in records] == [1, 1, 2, 3, 4]
    assert [int(r["packed_chunks"]) for r in records] == [1, 1, 2, 2, 2]
    assert [int(r["tokens_written"]) for r in records] == [
        CHUNK_TOKENS * (i + 1) for i in range(CHUNKS)]
    assert int(records[-1]["tokens_written"]) > int(records[-1]["cache_tokens"]) == CACHE_TOKENS
    for r in records[1:]:
        assert int(r["resident_bytes"]) < int(r["dense_bytes"])
    assert stream.frames.std() > 0
    assert np.array_equal(stream.chunks[0], off.chunks[0])  # chunk 0 attends to bf16 K/V only
    assert not np.array_equal(stream.frames, off.frames)  # packed K/V changed later chunks
    last = records[-1]
    print(f"realtime LingBot-World {mode}: PSNR vs off {psnr(stream.frames, off.frames):.2f} dB, "
          f"resident {last['resident_bytes']} of {last['dense_bytes']} B after {CHUNKS} chunks, "
          f"{last['packed_chunks']} chunks packed now, {last['quantize_calls']} packed in all")


def test_int4_holds_more_bytes_than_int2_and_stays_closer_to_quant_off(realtime_runs):
    """Same chunks packed, same centroids and scales: int4's residual codes are twice as wide,
    and its stream is nearer quant off's than int2's."""
    int4, int2 = (probe_records(realtime_runs[m][0]) for m in ("int4", "int2"))
    for a, b in zip(int4[1:], int2[1:], strict=True):
        assert a["packed_chunks"] == b["packed_chunks"]
        assert int(b["resident_bytes"]) < int(a["resident_bytes"]) < int(a["dense_bytes"])
    off = realtime_runs["off"][1].frames
    assert psnr(realtime_runs["int4"][1].frames, off) > psnr(realtime_runs["int2"][1].frames, off)


def test_sglangs_own_codec_refuses_at_its_first_pack_without_quant_videogen(realtime_runs):
    """``CAUSALKV_SGLANG_LINGBOT_QVG=sglang`` keeps sglang's own ``QVGPackedCausalKVCache``
    (the allocation line says so). Its codec is quant-videogen's Triton kernels, which this
    environment does not install (requirements/sglang.txt): chunk 0 is served (nothing to pack
    yet, and it equals quant off's), then chunk 1's first pack raises sglang's ImportError and
    sglang's realtime loop sends it as the session's error."""
    assert importlib.util.find_spec("quant_videogen") is None
    log, stream = realtime_runs["sglang-codec"]
    _, off = realtime_runs["off"]
    (line,) = serving_lines(log)
    assert "KV cache sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache." in line
    assert "QVGPackedCausalKVCache x 2 blocks, served by sglang, int2," in line
    assert "(CAUSALKV_SGLANG_LINGBOT_QVG=sglang)" in line
    assert len(stream.chunks) == 1 and np.array_equal(stream.chunks[0], off.chunks[0])
    refusal = "Quant-VideoGen KV-cache quantization requires its optional runtime dependencies"
    (error,) = stream.errors
    assert error.startswith("error during generate loop: ") and refusal in error
    assert refusal in log
    assert [int(r["chunk"]) for r in probe_records(log)] == [0]
