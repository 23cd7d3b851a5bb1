"""Every bad input raises CacheWriteError (or ValueError) naming the values, and leaves the
dense cache exactly as it was: cursors, pin, retained set and both buffers, bit for bit."""

from __future__ import annotations

import pytest
import torch
from oracle import OracleCache, encode_kv, run_sequence

from causalkv.caches import CacheWriteError, CausalCacheSpec, DenseCausalKVCache
from causalkv.caches.passes import CommitPass

SPEC = CausalCacheSpec(
    batch_size=2, num_heads=4, head_dim=4, cache_size=16, sink_tokens=4, global_sink_tokens=2,
    attention_window_size=12, dtype=torch.float32,
)


def busy_cache() -> DenseCausalKVCache:
    """Six chunks of 3 tokens, a shot sink pinned at chunk 2, a head-slice rewrite last:
    global_end 18, current chunk [15, 18), pinned [6, 9), and [2, 4) already evicted."""
    cache = DenseCausalKVCache(SPEC)
    wid = 0
    for c in range(6):
        wid += 1
        k, v = encode_kv(SPEC, 3 * c, 3, 0, 4, wid)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * c)
        if c == 2:
            cache.pin_current_chunk(3)
    k, v = encode_kv(SPEC, 15, 3, 1, 2, wid + 1)
    cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=15, cache_head_start=1)
    return cache


def snapshot(cache: DenseCausalKVCache):
    return cache.state, cache.k_cache.clone(), cache.v_cache.clone()


def assert_unchanged(cache: DenseCausalKVCache, before) -> None:
    state, k, v = before
    assert cache.state == state
    assert cache.k_cache.shape == k.shape and torch.equal(cache.k_cache, k)
    assert cache.v_cache.shape == v.shape and torch.equal(cache.v_cache, v)


def test_busy_cache_is_what_the_docstring_says():
    cache = busy_cache()
    assert (cache.state.global_end, cache.state.cur_start, cache.state.cur_n) == (18, 15, 3)
    assert cache.state.pinned == (6, 9)
    # sink = [0, 2) global + [6, 9) pinned = 5 tokens; the other 11 of 16 slots keep the newest
    # ordinary tokens of [2, 6) [9, 18) (13 of them): [4, 6) [9, 18). Retained: [0, 2) [4, 18).
    assert cache.state.retained == ((0, 2), (4, 18))


def _kv(n=3, *, h=4, b=2, d=4, dtype=torch.float32, device="cpu", start=18):
    k, v = encode_kv(SPEC, start, n, 0, min(h, 4), 99)
    if (h, b, d) != (min(h, 4), 2, 4):
        k = torch.ones(b, n, h, d)
        v = torch.ones(b, n, h, d)
    return k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)


def _write(cache, *, start=18, key=None, value=None, **kw):
    k, v = _kv()
    return cache.update_and_get_attention_kv(
        key=k if key is None else key, value=v if value is None else value,
        current_chunk_start=start, debug_name="blocks.3.self_attn", **kw,
    )


BAD_WRITES = {
    "ahead": (dict(start=19), CacheWriteError,
              ["blocks.3.self_attn", "non-sequential write current_start=19 global_end=18 cur=15"]),
    "behind": (dict(start=12), CacheWriteError,
               ["non-sequential write current_start=12 global_end=18 cur=15"]),
    "rewrite_resized": (dict(start=15, key=_kv(2)[0], value=_kv(2)[1]), CacheWriteError,
                        ["rewrite of chunk at 15 changed size: 2 tokens", "the chunk has 3"]),
    "head_slice_past_end": (dict(key=_kv(h=2)[0], value=_kv(h=2)[1], cache_head_start=3),
                            CacheWriteError, ["head slice [3, 5)", "heads [0, 4)"]),
    "head_slice_negative": (dict(key=_kv(h=2)[0], value=_kv(h=2)[1], cache_head_start=-1),
                            CacheWriteError, ["head slice [-1, 1)", "heads [0, 4)"]),
    "too_many_heads": (dict(key=_kv(h=5)[0], value=_kv(h=5)[1]), CacheWriteError,
                       ["head slice [0, 5)", "heads [0, 4)"]),
    "batch": (dict(key=_kv(b=1)[0], value=_kv(b=1)[1]), CacheWriteError,
              ["batch 1", "batch_size=2"]),
    "head_dim": (dict(key=_kv(d=8)[0], value=_kv(d=8)[1]), CacheWriteError,
                 ["head_dim 8", "head_dim=4"]),
    "dtype": (dict(key=_kv(dtype=torch.bfloat16)[0], value=_kv(dtype=torch.bfloat16)[1]),
              CacheWriteError, ["key dtype torch.bfloat16", "spec dtype torch.float32"]),
    "value_dtype_only": (dict(value=_kv(dtype=torch.float16)[1]), CacheWriteError,
                         ["value dtype torch.float16"]),
    "device_meta": (dict(key=_kv(device="meta")[0], value=_kv(device="meta")[1]),
                    CacheWriteError, ["key is on meta", "cpu"]),
    "key_value_shapes": (dict(value=_kv(2)[1]), CacheWriteError,
                         ["key shape (2, 3, 4, 4) != value shape (2, 2, 4, 4)"]),
    "three_dims": (dict(key=torch.ones(2, 3, 4), value=torch.ones(2, 3, 4)), CacheWriteError,
                   ["[B, n, h, D]", "(2, 3, 4)"]),
    "not_a_tensor": (dict(key=[[1.0]]), CacheWriteError, ["key must be a torch.Tensor", "list"]),
    "empty_chunk": (dict(key=_kv(0)[0], value=_kv(0)[1]), CacheWriteError, ["n=0"]),
    "start_not_int": (dict(start=18.0), CacheWriteError,
                      ["current_chunk_start must be an int", "float"]),
    "start_tensor": (dict(start=torch.tensor(18)), CacheWriteError,
                     ["current_chunk_start must be an int", "Tensor"]),
    "too_big_for_cache": (dict(key=_kv(12)[0], value=_kv(12)[1]), CacheWriteError,
                          ["chunk of 12 tokens plus 5 sink tokens", "cache_size=16",
                           "allow_growth=True"]),
    "negative_recent_window": (dict(recent_window_tokens=-1), ValueError,
                               ["recent_window_tokens", "-1"]),
}


@pytest.mark.parametrize("case", sorted(BAD_WRITES))
def test_bad_write_raises_and_leaves_cache_unchanged(case):
    kwargs, error, fragments = BAD_WRITES[case]
    cache = busy_cache()
    before = snapshot(cache)
    with pytest.raises(error) as info:
        _write(cache, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert_unchanged(cache, before)
    # and the cache carries on: the next advance works
    k, v = encode_kv(SPEC, 18, 3, 0, 4, 100)
    view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=18)
    assert view.positions.tolist()[-3:] == [18, 19, 20]


BAD_PINS = {
    "more_than_written": (19, ["pin_current_chunk(19)", "only 18 tokens"]),
    "already_evicted": (17, ["pin_current_chunk(17)", "[1, 5) is no longer retained"]),
    "not_an_int": (1.5, ["current_num_tokens must be an int", "1.5"]),
}


@pytest.mark.parametrize("case", sorted(BAD_PINS))
def test_bad_pin_raises_and_leaves_cache_unchanged(case):
    n, fragments = BAD_PINS[case]
    cache = busy_cache()
    before = snapshot(cache)
    with pytest.raises(CacheWriteError) as info:
        cache.pin_current_chunk(n)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert_unchanged(cache, before)


@pytest.mark.parametrize("halves", [False, True])
def test_a_commit_whose_pin_is_refused_leaves_the_cache_unchanged(halves):
    """A context pass that asks for a pin the cache can no longer make is refused whole: the
    chunk [15, 18) was committed telling a next chunk of 9 tokens, which drops position 15
    (16 slots: the 5 sink tokens, [16, 18) and the 9 new ones), so pinning it again fails.
    Written in two halves, the first half (not yet the whole pass) is stored and the second,
    which would complete the pass and pin, is refused with nothing of it written."""
    cache = busy_cache()
    k, v = encode_kv(SPEC, 15, 3, 0, 4, 100)
    cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=15,
                                      commit=CommitPass(next_tokens=9))
    assert cache.state.retained == ((0, 2), (6, 9), (16, 18))
    parts = [(0, 2), (2, 2)] if halves else [(0, 4)]
    for h0, h in parts[:-1]:
        k, v = encode_kv(SPEC, 15, 3, h0, h, 101)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=15,
                                          cache_head_start=h0, commit=CommitPass(pin=True))
    before = snapshot(cache)
    h0, h = parts[-1]
    k, v = encode_kv(SPEC, 15, 3, h0, h, 102)
    with pytest.raises(CacheWriteError, match=r"pin_current_chunk\(3\): range \[15, 18\) is no longer retained"):
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=15,
                                          cache_head_start=h0, commit=CommitPass(pin=True))
    assert_unchanged(cache, before)


def test_negative_recent_window_on_read_is_a_value_error():
    cache = busy_cache()
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"recent_window_tokens must be an int >= 0 or None, got -3"):
        cache.get_attention_kv(recent_window_tokens=-3)
    with pytest.raises(ValueError, match=r"recent_window_tokens must be an int >= 0 or None, got True"):
        cache.get_attention_kv(recent_window_tokens=True)  # a bool is not a token count
    assert_unchanged(cache, before)


def test_first_write_must_start_at_zero():
    cache = DenseCausalKVCache(SPEC)
    before = snapshot(cache)
    k, v = encode_kv(SPEC, 3, 3, 0, 4, 1)
    with pytest.raises(CacheWriteError, match="current_start=3 global_end=0 cur=None"):
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3)
    assert_unchanged(cache, before)


def test_growth_turns_the_fit_error_into_a_bigger_buffer():
    spec = CausalCacheSpec(1, 1, 4, cache_size=6, sink_tokens=2, dtype=torch.float32,
                       allow_growth=True)
    cache = DenseCausalKVCache(spec)
    k, v = encode_kv(spec, 0, 2, 0, 1, 1)
    cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    k, v = encode_kv(spec, 2, 7, 0, 1, 2)
    view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=2)
    assert cache.k_cache.shape[1] == 9  # sink 2 + chunk 7
    assert cache.state.retained == ((0, 9),)
    # the attention window stays cache_size = 6: the sink and the newest 4 tokens
    assert view.positions.tolist() == [0, 1, 5, 6, 7, 8]
    assert cache.resident_nbytes() == 2 * 9 * 4 * 4
    cache.reset_indices()
    assert cache.k_cache.shape[1] == 6 and cache.resident_nbytes() == 2 * 6 * 4 * 4


def test_error_states_match_the_oracle_verdicts():
    """The oracle agrees on the busy cache's shape (so the cases above are the real ones)."""
    oracle = OracleCache.from_spec(SPEC)
    for c in range(6):
        oracle.write(3 * c, 3, None, 4, None, c + 1)
        if c == 2:
            oracle.pin(3)
    assert sorted(oracle.retained) == [0, 1, *range(4, 18)]
    assert oracle.pinned == (6, 9)


# ---- bad spec fields ------------------------------------------------------------------

GOOD = dict(batch_size=1, num_heads=2, head_dim=4, cache_size=8)
BAD_SPECS = {
    "batch_size": (dict(batch_size=0), ["batch_size", "0"]),
    "num_heads": (dict(num_heads=-1), ["num_heads", "-1"]),
    "head_dim": (dict(head_dim=2.0), ["head_dim", "2.0"]),
    "cache_size": (dict(cache_size=True), ["cache_size", "True"]),
    "sink_negative": (dict(sink_tokens=-1), ["sink_tokens", "-1"]),
    "sink_too_big": (dict(sink_tokens=9), ["sink_tokens=9", "cache_size=8"]),
    "global_sink_above_sink": (dict(sink_tokens=2, global_sink_tokens=3),
                               ["global_sink_tokens=3", "sink_tokens=2"]),
    "window_zero": (dict(attention_window_size=0), ["attention_window_size", "0"]),
    "window_too_big": (dict(attention_window_size=9), ["attention_window_size=9", "cache_size=8"]),
    "dtype": (dict(dtype="bfloat16"), ["dtype", "bfloat16"]),
    "device": (dict(device="gpu:x"), ["gpu:x"]),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_spec_field_is_a_value_error_naming_field_and_value(case):
    kwargs, fragments = BAD_SPECS[case]
    with pytest.raises((ValueError, RuntimeError)) as info:
        CausalCacheSpec(**{**GOOD, **kwargs})
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_the_busy_cache_matches_the_oracle_throughout():
    """run_sequence over the same stream (full writes; the oracle checks values too)."""
    from oracle import Pin, Write

    ops = [Write("advance", n=3)] * 3 + [Pin()] + [Write("advance", n=3)] * 3
    ops += [Write("rewrite", h0=1, h=2)]
    assert sorted(run_sequence(DenseCausalKVCache, SPEC, ops).retained) == [0, 1, *range(4, 18)]


@pytest.mark.parametrize(
    ("h0", "num_heads", "fragment"),
    [(3, 2, "[3, 5)"), (None, 5, "[0, 5)"), (-1, 2, "[-1, 1)"), (2, 0, "[2, 2)")],
)
def test_read_of_heads_outside_the_cache_is_refused(h0, num_heads, fragment):
    """A read must not silently return fewer heads than asked for."""
    cache = busy_cache()
    before = snapshot(cache)
    with pytest.raises(CacheWriteError, match=r"outside the cache's heads \[0, 4\)") as info:
        cache.get_attention_kv(cache_head_start=h0, num_heads=num_heads)
    assert fragment in str(info.value)
    assert_unchanged(cache, before)
    assert cache.get_attention_kv(cache_head_start=1, num_heads=3).k.shape[2] == 3


@pytest.mark.parametrize(("h0", "num_heads"), [(True, 2), (1, True), (1.0, 2), (1, 2.0), ("1", 2)])
def test_a_head_slice_of_bools_or_floats_is_refused(h0, num_heads):
    """A bool is not a head index (True would read from head 1), a float not a count: the read
    and the write refuse both, and the cache is unchanged."""
    cache = busy_cache()
    before = snapshot(cache)
    with pytest.raises(CacheWriteError, match="cache_head_start and num_heads must be ints or None"):
        cache.get_attention_kv(cache_head_start=h0, num_heads=num_heads)
    if type(h0) is not int:  # a write of 2 heads at this start is refused too
        k = torch.zeros(2, 3, 2, 4)
        with pytest.raises(CacheWriteError, match="head slice"):
            cache.update_and_get_attention_kv(key=k, value=k, current_chunk_start=cache.global_end,
                                              cache_head_start=h0)
    assert_unchanged(cache, before)
