"""The admission formula of vLLM-Omni's paged AR-diffusion engine (`causalkv.vllm_omni.admission`,
no vLLM needed), against hand counts at LingBot-World's geometry, and ``causalkv memory lingbot
--host vllm-omni``. The bridge suite checks the same formula against the engine's own code
(tests/vllm_omni_bridge/test_paged_admission.py)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.errors import ConfigError
from causalkv.memory.records import SETTINGS
from causalkv.vllm_omni.admission import (
    EngineGeometry,
    admit,
    causalkv_layout,
    engine_stream,
    lingbot_engine,
    lingbot_model_state_bytes,
    plan_admission,
    required_bytes,
    stock_layout,
)

GiB = 1 << 30
PAGE = 2 * 1560 * 40 * 128 * 2 * 40  # one latent frame's K and V, bf16, all 40 layers
CROSS = 2 * 512 * 40 * 128 * 2 * 40  # the 512-token text cache, K and V, all layers
# vLLM-Omni 0.30.0's LingBot state at 480x832, bf16 (its ar_diffusion_kv_cache_spec, by term)
CONDITION = 20 * 3 * 60 * 104 * 2
CAMERA = 2 * 40 * 3 * 1560 * 40 * 128 * 2
ENCODER = 2 * 1404 * 480 * 832 * 2
DECODER = 9458 * 480 * 832 * 2 // 4
STATE = CONDITION + CAMERA + ENCODER + DECODER


def test_lingbot_engine_is_the_hand_count():
    eng = lingbot_engine()
    assert eng.page_bytes == PAGE == 1_277_952_000
    assert eng.cross_bytes == CROSS == 419_430_400
    assert eng.model_state_bytes == lingbot_model_state_bytes(480, 832) == STATE == 7_965_984_000
    assert eng.scratch_bytes == 3 * PAGE
    assert (eng.sink_frames, eng.window_frames, eng.frames_per_block) == (9, 9, 3)


def test_stock_admission_at_80GiB_by_hand():
    eng = lingbot_engine()
    a = admit(eng, stock_layout(eng), available_bytes=80 * GiB, gpu_memory_fraction=1.0,
              requested_capacity=2)
    fixed = 3 * PAGE + (3 + 2) * PAGE  # scratch, the in-flight tick, two spare blocks
    session = 18 * PAGE + CROSS + STATE
    assert (a.fixed_bytes, a.session_bytes) == (fixed, session) == (10_223_616_000, 31_388_550_400)
    assert a.capacity == (80 * GiB - fixed) // session == 2
    assert a.pool_blocks == (80 * GiB - 3 * PAGE - 2 * (CROSS + STATE)) // PAGE == 51
    assert required_bytes(eng, stock_layout(eng), 2) <= 80 * GiB < required_bytes(eng, stock_layout(eng), 3)


def test_int2_admission_at_80GiB_by_hand():
    eng = lingbot_engine()
    layout = causalkv_layout(eng, SETTINGS["int2-default"].quant_args(), "int2")
    # between ticks: the newest tick bf16 (3 frames), the 3 sink ticks and one more packed
    assert layout.bf16_frames == 3
    codec = __import__("causalkv.caches.codecs", fromlist=["make_codec"]).make_codec(
        "int2", SETTINGS["int2-default"].quant_args())
    per_tick = 2 * codec.nbytes((1, 40, 3 * 1560, 128)) * 40  # K and V, all layers
    assert layout.packed_bytes == 4 * per_tick == 2_516_096_000
    a = admit(eng, layout, available_bytes=80 * GiB, gpu_memory_fraction=1.0)
    assert a.session_bytes == 3 * PAGE + 4 * per_tick + CROSS + STATE == 14_735_366_400
    assert a.capacity == (80 * GiB - 8 * PAGE) // a.session_bytes == 5
    assert a.pool_blocks == (80 * GiB - 3 * PAGE - 5 * (CROSS + STATE + 4 * per_tick)) // PAGE == 21


def test_the_command_prints_the_admission():
    from causalkv.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", "lingbot", "--host", "vllm-omni", "--budget", "80GiB"]) == 0
    text = out.getvalue()
    rows = {line.split()[0]: line.split()[-1] for line in text.splitlines()[2:6]}
    assert rows == {"stock": "2", "off": "2", "int4": "4", "int2": "5"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", "lingbot", "--host", "vllm-omni", "--budget", "80GiB", "--json"]) == 0
    got = {r["setting"]: r for r in json.loads(out.getvalue())}
    assert [a.as_json() for a in plan_admission(80 * GiB)] == list(got.values())
    assert got["int2"]["sessions"] >= 2.5 * got["stock"]["sessions"]


def test_refusals():
    eng = lingbot_engine()
    with pytest.raises(ConfigError, match="one session needs 41,612,166,400 bytes"):
        admit(eng, stock_layout(eng), available_bytes=20 * GiB)
    with pytest.raises(ConfigError, match="gpu_memory_fraction must be in \\(0, 1\\]"):
        admit(eng, stock_layout(eng), available_bytes=80 * GiB, gpu_memory_fraction=0)
    for fraction in (True, float("nan"), "0.5", 10**400):  # a bool is not a fraction (True would be 1.0)
        with pytest.raises(ConfigError, match="gpu_memory_fraction must be in \\(0, 1\\]"):
            admit(eng, stock_layout(eng), available_bytes=80 * GiB, gpu_memory_fraction=fraction)
    with pytest.raises(ConfigError, match="session_capacity"):
        admit(eng, stock_layout(eng), available_bytes=80 * GiB, requested_capacity=0)
    odd = EngineGeometry("odd", 1, 1, 64, "bfloat16", 16, 3, 4, 8)
    with pytest.raises(ConfigError, match="whole 3-frame ticks"):
        engine_stream(odd)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        EngineGeometry("x", 1, 1, 64, "int8", 16, 3, 3, 6)
    with pytest.raises(ConfigError, match="budget"):
        plan_admission(0)


def test_the_budget_rule_raises_to_one_session_when_it_fits():
    """vLLM-Omni's rule: a budget below one session is raised to it when one fits free memory."""
    eng = lingbot_engine()
    a = admit(eng, stock_layout(eng), available_bytes=40 * GiB, gpu_memory_fraction=0.1)
    assert a.configured_budget_bytes == int(40 * GiB * 0.1)
    assert a.memory_budget_bytes == required_bytes(eng, stock_layout(eng), 1)
    assert a.capacity == 1


def test_off_is_stock_minus_the_unread_tick():
    eng = lingbot_engine()
    off = causalkv_layout(eng, QVGKVQuantArgs())
    assert (off.bf16_frames, off.packed_bytes) == (15, 0)
    assert stock_layout(eng).bf16_frames == 18


@pytest.mark.parametrize(("layers", "heads", "head_dim"), [(2, 2, 64), (8, 8, 128), (40, 40, 128)])
@pytest.mark.parametrize("model_state", ["none", "lingbot"])
def test_no_dit_reaches_two_and_a_half_times_at_the_tiny_checkpoints_frame(layers, heads, head_dim,
                                                                           model_state):
    """Why the CPU runs show int2 holding 2.5x stock's sessions at LingBot-World's count, not at
    the tiny geometry's own bytes: at 64x64 (16 tokens per latent frame), sink 3 + window 6
    frames, a session's 512-token text cache outweighs its 144 tokens of K/V whatever the DiT
    (both scale with layers x heads x head_dim), so a stock session is less than 1.2x an int2
    one, with no model-owned state or with LingBot's (vLLM-Omni's declaration at 64x64, mostly
    its streaming VAE decoder's, per output pixel; 1.004x for the tiny checkpoint as the
    engine counts it, demo/vllm_omni/run_paged.py). At every budget where stock's bytes admit
    N >= 2 sessions, int2 admits fewer than 2.5 N."""
    state = 0 if model_state == "none" else lingbot_model_state_bytes(
        64, 64, num_layers=layers, num_heads=heads, head_dim=head_dim, itemsize=4)
    eng = EngineGeometry("tiny", layers, heads, head_dim, "float32", 16, 3, 3, 6,
                         cross_attention=((512, heads),), model_state_bytes=state)
    stock, int2 = stock_layout(eng), causalkv_layout(eng, SETTINGS["int2-default"].quant_args())
    one = admit(eng, stock, available_bytes=required_bytes(eng, stock, 1), gpu_memory_fraction=1.0)
    mine = admit(eng, int2, available_bytes=required_bytes(eng, int2, 1), gpu_memory_fraction=1.0)
    assert eng.cross_bytes > stock.bf16_frames * eng.page_bytes  # 512 tokens against 9 x 16
    assert one.session_bytes / mine.session_bytes < 1.2
    for n in range(2, 11):
        budget = required_bytes(eng, stock, n)  # stock's bytes admit exactly n
        got = admit(eng, int2, available_bytes=budget, gpu_memory_fraction=1.0).capacity
        assert admit(eng, stock, available_bytes=budget, gpu_memory_fraction=1.0).capacity == n
        assert got < 2.5 * n, (n, got)


def test_both_planners_name_every_unknown_row_before_planning_any() -> None:
    from causalkv.vllm_omni.admission import plan_sessions

    with pytest.raises(ConfigError, match=r"rows must be among \[.*'int2'.*\], got \['int3', 'x'\]"):
        plan_sessions(rows=("int2", "int3", "x"))
    with pytest.raises(ConfigError, match=r"rows must be among \['stock', .*\], got \['int3'\]"):
        plan_admission(80 * GiB, rows=("stock", "int3"))
