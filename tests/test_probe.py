"""Probes: ``update_and_get_attention_kv(..., probe=True)`` stores nothing and answers the write.

Oracle: the same write, unmarked, on a deep copy of the cache (the dense cache's answer for
that call), and a twin cache that never saw the probes (what later calls must see). Random
streams of advances (chunk sizes vary), rewrites, pins, head slices, recent windows and
resets, with probes interleaved, on the dense cache and on the packed cache with
quantization off (bit for bit) and on (the probe's history is what the store holds: the
packed cache's own view within the codec's bound of the dense answer).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from causalkv.caches import CausalCacheSpec, DenseCausalKVCache
from causalkv.caches.qvg import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.spec import CacheWriteError

H, D = 4, 32
SPEC = CausalCacheSpec(batch_size=1, num_heads=H, head_dim=D, cache_size=40, sink_tokens=6,
                   global_sink_tokens=3, attention_window_size=34)
OFF = QVGKVQuantArgs()
INT4 = QVGKVQuantArgs(codec="int4", centroids=4, block_size=16, keep_recent_chunks=0)


def _kv(rng: random.Random, n: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return tuple(torch.randn(1, n, h, D, generator=g).to(torch.bfloat16) for _ in range(2))


def _same(a, b, where: str, atol: float = 0.0) -> None:
    assert a.position_ranges == b.position_ranges, where
    assert (a.local_start_index, a.local_end_index, a.visible_local_end, a.visible_global_end) == (
        b.local_start_index, b.local_end_index, b.visible_local_end, b.visible_global_end), where
    for x, y in ((a.k, b.k), (a.v, b.v)):
        assert x.shape == y.shape, where
        if atol == 0.0:
            assert torch.equal(x, y), where
        else:
            assert (x.float() - y.float()).abs().max().item() <= atol, where


def _stream(make, seed: int, steps: int = 40) -> tuple[int, int]:
    """Drive ``make()`` (probed) and a twin (never probed); returns (probes, refusals)."""
    rng = random.Random(seed)
    probed, twin = make(), make()
    probes = refused = 0
    cur: tuple[int, int] | None = None  # start, n of the current chunk
    for step in range(steps):
        op = rng.choice(["advance", "advance", "rewrite", "probe", "probe", "probe", "pin", "reset"])
        end = probed.global_end
        if op == "reset":
            probed.reset_indices()
            twin.reset_indices()
            cur = None
            continue
        if op == "pin":
            n = rng.choice([0, cur[1] if cur else 0, 2])
            try:
                probed.pin_current_chunk(n)
            except CacheWriteError:
                with pytest.raises(CacheWriteError):
                    twin.pin_current_chunk(n)
                continue
            twin.pin_current_chunk(n)
            continue
        at_rewrite = op == "rewrite" or (op == "probe" and cur is not None and rng.random() < 0.4)
        start, n = (cur if at_rewrite and cur else (end, rng.choice([4, 6, 8, 8, 12])))
        h0, h = rng.choice([(None, H), (0, 2), (2, 2)])
        recent = rng.choice([None, None, 10])
        k, v = _kv(rng, n, h)
        kw = dict(key=k, value=v, current_chunk_start=start, cache_head_start=h0,
                  recent_window_tokens=recent, debug_name=f"step {step}")
        if op == "probe":
            oracle = copy.deepcopy(probed)
            try:
                want = oracle.update_and_get_attention_kv(**kw)
            except CacheWriteError:
                with pytest.raises(CacheWriteError):
                    probed.update_and_get_attention_kv(**kw, probe=True)
                refused += 1
                continue
            before = probed.resident_nbytes()
            got = probed.update_and_get_attention_kv(**kw, probe=True)
            _same(got, want, f"seed {seed} step {step}: probe vs the write on a copy")
            assert probed.resident_nbytes() == before, "a probe stored something"
            probes += 1
            continue
        try:
            a = probed.update_and_get_attention_kv(**kw)
        except CacheWriteError:
            with pytest.raises(CacheWriteError):
                twin.update_and_get_attention_kv(**kw)
            continue
        b = twin.update_and_get_attention_kv(**kw)
        _same(a, b, f"seed {seed} step {step}: a later write sees what it would without probes")
        assert probed.resident_nbytes() == twin.resident_nbytes()
        cur = (start, n)
    return probes, refused


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["dense", "packed-off"])
def test_a_probe_answers_the_write_and_changes_nothing(kind: str, seed: int):
    make = (lambda: DenseCausalKVCache(SPEC)) if kind == "dense" else (
        lambda: QVGPackedCausalKVCache(SPEC, OFF))
    probes, _ = _stream(make, seed)
    assert probes > 0


@pytest.mark.parametrize("seed", range(4))
def test_a_packed_probe_reads_the_packed_history_within_the_codec_bound(seed: int):
    """int4 on: the probe's view equals the packed cache's own write on a copy wherever that
    write reads the same storage, and is within the codec's error of the dense answer."""
    rng = random.Random(seed)
    packed, dense = QVGPackedCausalKVCache(SPEC, INT4), DenseCausalKVCache(SPEC)
    for c in range(8):
        n = 8
        k, v = _kv(rng, n, H)
        for cache in (packed, dense):
            cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * n)
    assert packed.quantize_calls > 0
    k, v = _kv(rng, 8, H)
    kw = dict(key=k, value=v, current_chunk_start=packed.global_end)
    got = packed.update_and_get_attention_kv(**kw, probe=True)
    want = copy.deepcopy(dense).update_and_get_attention_kv(**kw)
    _same(got, want, "int4 probe vs dense write", atol=0.75)
    assert not torch.equal(got.k, want.k)  # the history really was read from packed records
    n = 8
    assert torch.equal(got.k[:, -n:], k) and torch.equal(got.v[:, -n:], v)


def test_a_refused_probe_changes_nothing():
    cache = QVGPackedCausalKVCache(SPEC, OFF)
    k, v = _kv(random.Random(0), 8, H)
    cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    before = copy.deepcopy(cache.state)
    with pytest.raises(CacheWriteError, match="non-sequential"):
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3, probe=True)
    assert cache.state == before
