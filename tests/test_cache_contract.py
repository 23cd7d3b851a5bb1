"""Property tests: the dense cache against the independent oracle (tests/oracle.py).

Each example is a tiny spec (B <= 2, H <= 4, D = 4, <= 20 slots, every sink / shot-sink /
window / growth mode) and up to 24 ops: advance, rewrite, head-slice write, resized rewrite,
skipped start, pin (current size, small, zero, negative), recent-window read, reset and
`can_direct_current_attention`. After every op the positions, cursors and exact k/v values
must equal the oracle's, and every bad call must fail without changing the cache.

The profile ``ci`` (the default) runs 2,000 + 400 + 300 = 2,700 sequences on the dense
cache; ``HYPOTHESIS_PROFILE=dev`` runs a tenth.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from oracle import (
    CanDirect,
    OracleCache,
    Pin,
    Read,
    Reset,
    Write,
    assert_caches_agree,
    examples,
    run_sequence,
    scenarios,
)

from causalkv.caches import CausalCacheSpec, DenseCausalKVCache

DENSE_SEQUENCES = examples(2000)


@settings(max_examples=DENSE_SEQUENCES)
@given(scenarios())
def test_dense_cache_matches_oracle(scenario):
    spec, ops = scenario
    run_sequence(DenseCausalKVCache, spec, ops)


@settings(max_examples=examples(400))
@given(scenarios(max_ops=48, errors=False))
def test_dense_cache_matches_oracle_long_valid_streams(scenario):
    spec, ops = scenario
    run_sequence(DenseCausalKVCache, spec, ops)


@settings(max_examples=examples(300))
@given(scenarios(dtype=torch.bfloat16))
def test_dense_cache_matches_oracle_bf16(scenario):
    """bf16 holds the marker values exactly (positions < 200, write ids <= 24, D = 4)."""
    spec, ops = scenario
    run_sequence(DenseCausalKVCache, spec, ops)


# ---- the driver itself catches wrong caches ------------------------------------------


class _NoSinkDense(DenseCausalKVCache):
    """A broken cache: its view forgets the pinned shot sink."""

    def pin_current_chunk(self, current_num_tokens: int) -> None:
        return None


class _StaleRewriteDense(DenseCausalKVCache):
    """A broken cache: a rewrite of the current chunk is silently dropped."""

    def update_and_get_attention_kv(self, *, current_chunk_start, key, value, **kw):
        if self.state.cur_start == current_chunk_start:
            return self.get_attention_kv(
                cache_head_start=kw.get("cache_head_start"),
                num_heads=key.shape[2],
                recent_window_tokens=kw.get("recent_window_tokens"),
            )
        return super().update_and_get_attention_kv(
            key=key, value=value, current_chunk_start=current_chunk_start, **kw
        )


SHOT_SPEC = CausalCacheSpec(
    batch_size=1, num_heads=2, head_dim=4, cache_size=12, sink_tokens=2, global_sink_tokens=2,
    dtype=torch.float32,
)
SHOT_OPS = [Write("advance", n=4), Write("advance", n=4), Pin(), Write("advance", n=4),
            Write("advance", n=4), Write("advance", n=4)]


def test_driver_passes_the_dense_cache_on_a_fixed_stream():
    oracle = run_sequence(DenseCausalKVCache, SHOT_SPEC, SHOT_OPS)
    # sink [0, 2), pinned [4, 6) of the second chunk, newest 8 ordinary tokens of 20
    assert oracle.visible() == [0, 1, 4, 5, *range(12, 20)]


@pytest.mark.parametrize(
    ("broken", "ops"),
    [
        (_NoSinkDense, SHOT_OPS),
        (_StaleRewriteDense, [Write("advance", n=3), Write("rewrite")]),
    ],
)
def test_driver_rejects_a_broken_cache(broken, ops):
    with pytest.raises(AssertionError):
        run_sequence(broken, SHOT_SPEC, ops)
    with pytest.raises(AssertionError):
        assert_caches_agree(DenseCausalKVCache, broken, SHOT_SPEC, ops)


# ---- regressions found by the property test ------------------------------------------


def test_clearing_a_pin_does_not_resurrect_evicted_sink_tokens():
    """With sink 4 / global sink 2, pinning lets [2, 4) roll out; clearing the pin then
    must not make [2, 4) visible again (the cache no longer holds them)."""
    spec = CausalCacheSpec(
        batch_size=1, num_heads=1, head_dim=4, cache_size=8, sink_tokens=4,
        global_sink_tokens=2, dtype=torch.float32,
    )
    ops = [Write("advance", n=4), Write("advance", n=2), Pin(), Write("advance", n=2),
           Write("advance", n=2), Pin(0), Read(), Write("advance", n=2), Write("rewrite")]
    # at the Read: sink [0, 2) (what is left of [0, 4)), then the ordinary tokens [4, 10)
    assert run_sequence(DenseCausalKVCache, spec, ops[:7]).visible() == [0, 1, *range(4, 10)]
    # the former pinned range [4, 6) is ordinary again and rolls out
    assert run_sequence(DenseCausalKVCache, spec, ops).visible() == [0, 1, *range(6, 12)]


def test_oracle_can_direct_and_reset():
    o = OracleCache(batch_size=1, num_heads=1, head_dim=4, cache_size=4)
    assert o.can_direct(4) and not o.can_direct(5) and not o.can_direct(0)
    run_sequence(DenseCausalKVCache, CausalCacheSpec(1, 1, 4, 4, dtype=torch.float32),
                 [CanDirect(4), Write("advance", n=2), CanDirect(2), Reset(), CanDirect(4)])
