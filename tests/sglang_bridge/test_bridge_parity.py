"""(c) sglang's call patterns: the bridge's cache equals sglang's own caches bit for bit (quant off).

Each hypothesis example is one stream of the calls sglang's stages and attention layers make
(chunk advances, the denoise-step and context-update rewrites of the current chunk, LongLive
2.0 pins with a global sink, LingBot head slices with ``cache_head_start`` and recent
windows, i2v's one-frame first chunk, growth, ``reset_indices``) plus the rewrites of any
in-window range and the overlapping advances sglang's dense cache accepts. The oracle is
sglang's own ``CausalSelfAttentionKVCache`` run side by side: every view (K, V, the four
cursors), the index tensors and their int twins, the pin and ``can_direct_current_attention``
must be equal. sglang's own ``QVGPackedCausalKVCache`` (quant off) runs too while it accepts
the stream (no pin, no global sink, no growth, window == cache, sequential writes): its K/V
must equal the bridge's on the written heads (chunk-aligned streams: see `_make`).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import examples
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
    CausalAttentionKVView,
    CausalSelfAttentionKVCache,
)
from sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache import QVGPackedCausalKVCache

from causalkv.caches.spec import CacheWriteError
from causalkv.sglang.cache import SGLangQVGKVCache

DT = torch.bfloat16
D = 4
SEQUENCES = 1000
STATS = {"sequences": 0, "writes": 0, "qvg_compared": 0, "refused": 0}


@st.composite
def streams(draw):
    n = draw(st.integers(2, 5))  # tokens per chunk
    heads = draw(st.sampled_from([2, 4]))
    sink = draw(st.sampled_from([0, 0, n, 2 * n]))
    cache = sink + n * draw(st.integers(1, 4)) + draw(st.sampled_from([0, 0, 1, n - 1]))
    window = draw(st.sampled_from([cache, cache, max(1, cache - n), max(1, cache // 2)]))
    cfg = {
        "n": n, "heads": heads, "sink": sink, "cache": cache, "window": window,
        "global_sink": draw(st.sampled_from([0, sink])),
        "growth": draw(st.booleans()) and draw(st.booleans()),
        "int_indices": draw(st.booleans()),
        # LingBot ulysses/TP: the key holds a slice of the cache heads at cache_head_start
        "slice": draw(st.sampled_from([None, None, (0, heads // 2), (heads // 2, heads)])),
        # (b): with all heads, sglang ignores whatever cache_head_start is passed
        "head_start": draw(st.sampled_from([None, 0, 1])),
        "first_one_frame": draw(st.booleans()),
    }
    ops = draw(st.lists(st.sampled_from(
        ["chunk"] * 6 + ["pin", "rewrite_old", "overlap", "reset", "rwt"]), min_size=3, max_size=10))
    return cfg, ops, draw(st.randoms(use_true_random=False))


def _make(cfg, seed):
    idx = dict(global_end_index=torch.zeros(1, dtype=torch.long),
               local_end_index=torch.zeros(1, dtype=torch.long))
    shape = (1, cfg["cache"], cfg["heads"], D)
    i0 = 0 if cfg["int_indices"] else None
    ref = CausalSelfAttentionKVCache(
        k=torch.zeros(shape, dtype=DT), v=torch.zeros(shape, dtype=DT), **idx,
        global_end_index_int=i0, local_end_index_int=i0, cache_size=cfg["cache"],
        sink_tokens=cfg["sink"], attention_window_size=cfg["window"], allow_growth=cfg["growth"],
        global_sink_tokens=cfg["global_sink"],
    )
    common = dict(batch_size=1, cache_size=cfg["cache"], num_heads=cfg["heads"], head_dim=D,
                  dtype=DT, device=torch.device("cpu"), use_int_indices=cfg["int_indices"],
                  sink_tokens=cfg["sink"], attention_window_size=cfg["window"],
                  quant_args=QVGKVQuantArgs())
    ours = SGLangQVGKVCache(
        **common, global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long),
        global_sink_tokens=cfg["global_sink"], allow_growth=cfg["growth"],
    )
    qvg = None
    # sglang's packed cache assumes chunk-aligned windows: with a cache that is not a whole
    # number of chunks it can show a token its dense cache already evicted (e.g. n=2,
    # cache=3, recent_window_tokens=4 after two chunks: 4 tokens against 3); the bridge
    # follows the dense cache, so only aligned streams are compared with it.
    aligned = (cfg["cache"] - cfg["sink"]) % cfg["n"] == 0 and not cfg["first_one_frame"]
    if cfg["global_sink"] == 0 and not cfg["growth"] and cfg["window"] == cfg["cache"] and aligned:
        qvg = QVGPackedCausalKVCache(**common, global_end_index=torch.zeros(1, dtype=torch.long),
                                     local_end_index=torch.zeros(1, dtype=torch.long))
    return ref, ours, qvg


def _state(c):
    return (int(c.global_end_index.item()), int(c.local_end_index.item()),
            c.global_end_index_int, c.local_end_index_int, c.cache_size,
            c.attention_window_size, c.pinned_start, c.pinned_len, c.num_cache_heads,
            c.global_sink_tokens, c.sink_tokens)


def _cursors(view):
    return (view.local_start_index, view.local_end_index, view.visible_local_end,
            view.visible_global_end)


@settings(max_examples=examples(SEQUENCES))
@given(streams())
def test_views_equal_sglangs_caches(stream):
    cfg, ops, rnd = stream
    ref, ours, qvg = _make(cfg, rnd.random())
    gen = torch.Generator().manual_seed(rnd.randrange(2**31))
    heads = cfg["heads"] if cfg["slice"] is None else cfg["slice"][1] - cfg["slice"][0]
    head_start = cfg["head_start"] if cfg["slice"] is None else cfg["slice"][0]
    h0, h1 = (0, cfg["heads"]) if cfg["slice"] is None else cfg["slice"]
    rwt = None
    STATS["sequences"] += 1

    def write(start, n, *, may_refuse):
        nonlocal qvg
        key = torch.randn(1, n, heads, D, generator=gen).to(DT)
        value = torch.randn(1, n, heads, D, generator=gen).to(DT)
        kw = dict(key=key, value=value, current_chunk_start=start, cache_head_start=head_start,
                  recent_window_tokens=rwt)
        assert ours.can_direct_current_attention(n) == ref.can_direct_current_attention(n)
        try:
            expected = ref.update_and_get_attention_kv(**kw)
        except (RuntimeError, ValueError) as exc:  # sglang refuses: so must we, the same way
            with pytest.raises(type(exc), match="^" + _escape(str(exc)) + "$"):
                ours.update_and_get_attention_kv(**kw)
            return False
        try:
            got = ours.update_and_get_attention_kv(**kw)
        except CacheWriteError:
            assert may_refuse, "a write of sglang's stage pattern was refused"
            STATS["refused"] += 1
            return False
        STATS["writes"] += 1
        assert type(got) is CausalAttentionKVView
        assert got.k.shape == expected.k.shape and got.k.dtype == expected.k.dtype
        assert torch.equal(got.k, expected.k) and torch.equal(got.v, expected.v)
        assert _cursors(got) == _cursors(expected)
        assert _state(ours) == _state(ref)
        if qvg is not None:
            try:
                other = qvg.update_and_get_attention_kv(**kw)
            except NotImplementedError:  # outside what sglang's packed cache accepts
                qvg = None
            else:
                STATS["qvg_compared"] += 1
                # sglang's packed cache returns every head even for a head-slice write
                assert torch.equal(other.k[:, :, h0:h1], got.k)
                assert torch.equal(other.v[:, :, h0:h1], got.v)
        return True

    first = True
    for op in ops:
        g = ref.global_end_index_int
        g = int(ref.global_end_index.item()) if g is None else g
        n = cfg["n"]
        if op == "chunk":
            size = 1 if first and cfg["first_one_frame"] else n
            first = False
            # the stage's pattern: advance, denoise-step rewrites, the context-update rewrite
            for _ in range(1 + rnd.randrange(3)):
                if not write(g, size, may_refuse=False):
                    return
        elif op == "pin":
            m = rnd.choice([n, 0, 1, n + 1])
            ref.pin_current_chunk(m)
            ours.pin_current_chunk(m)
            qvg = None  # sglang's packed cache refuses pins (the seed error)
        elif op == "rewrite_old" and g > 0:
            length = rnd.randint(1, min(n, g))
            if not write(rnd.randint(max(0, g - cfg["cache"]), g - length), length, may_refuse=True):
                return
        elif op == "overlap" and g > 0:
            back = rnd.randint(1, min(n - 1, g)) if n > 1 else 1
            if not write(g - back, n, may_refuse=True):
                return
        elif op == "reset":
            ref.reset_indices()
            ours.reset_indices()
            if qvg is not None:
                qvg.reset_indices()
            first = True
        elif op == "rwt":
            rwt = rnd.choice([None, 0, 1, n, 2 * n])
        assert _state(ours) == _state(ref)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_sequence_count_reached():
    """Runs after the property (file order): every example was a sequence of real writes."""
    assert STATS["sequences"] >= examples(SEQUENCES)
    assert STATS["writes"] > 3 * STATS["sequences"]
    assert STATS["qvg_compared"] > 0
    print(f"sglang parity: {STATS}")
