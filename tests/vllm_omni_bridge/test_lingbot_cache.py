"""`LingBotLayerKV` against vLLM-Omni's own ``LingBotSelfAttention._update_cache`` on its own
``LingBotAttentionCache`` (the oracle), fed the same K/V: probes, commits, rewrites, errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from vllm_omni.diffusion.models.lingbot_world.transformer import (
    LingBotAttentionCache,
    LingBotSelfAttention,
)

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.spec import CausalCacheSpec
from causalkv.vllm_omni.lingbot_cache import allocate_layers

B, H, D = 1, 2, 64
N = 48            # one chunk: 3 frames x 16 tokens
SINK = 48         # 3 sink frames
CAP = 144         # 9-frame window
PROBES = 4


def _chunk(i: int, step: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * i + step)
    return (torch.randn(B, N, H, D, generator=g).to(dtype), torch.randn(B, N, H, D, generator=g).to(dtype))


def _stock(dtype=torch.float32) -> LingBotAttentionCache:
    z = torch.zeros(B, CAP, H, D, dtype=dtype)
    return LingBotAttentionCache(key=z.clone(), value=z.clone())


def _stock_update(cache, k, v, start, update):
    return LingBotSelfAttention._update_cache(None, cache, k, v, start, sink_tokens=SINK, update_cache=update)


def _ours(quant: str = "off", *, heads: int = H, head_offset: int = 0, dtype=torch.float32):
    spec = CausalCacheSpec(batch_size=B, num_heads=heads, head_dim=D, cache_size=CAP,
                           sink_tokens=SINK, dtype=dtype, device="cpu", head_offset=head_offset)
    layers, ledger = allocate_layers(spec, QVGKVQuantArgs.from_codec_name(quant), num_layers=1)
    return layers[0], ledger


def _schedule(chunks: int):
    """LingBot's DMD order: PROBES noisy probes (update_cache=False), then the commit."""
    for i in range(chunks):
        for step in range(PROBES + 1):
            yield i, step, step == PROBES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_off_returns_exactly_vllm_omnis_visible_kv(dtype):
    stock, (ours, _) = _stock(dtype), _ours(dtype=dtype)
    for i, step, commit in _schedule(7):
        k, v = _chunk(i, step, dtype)
        want = _stock_update(stock, k, v, i * N, commit)
        got = ours.update(k, v, i * N, sink_tokens=SINK, update_cache=commit)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (i, step)
        assert (ours.end, ours.absolute_end, ours.last_start, ours.sink_end) == (
            stock.end, stock.absolute_end, stock.last_start, stock.sink_end)
    # a rewrite of the current chunk (same start), probe then commit
    for commit in (False, True):
        k, v = _chunk(99, int(commit), dtype)
        want = _stock_update(stock, k, v, 6 * N, commit)
        got = ours.update(k, v, 6 * N, sink_tokens=SINK, update_cache=commit)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(("start", "message"), [
    (8 * N, "New chunks must be contiguous"),
    (N, "precedes the latest chunk start"),
    (2 * N + 1, "overlaps cached tokens"),
])
def test_refused_writes_raise_vllm_omnis_error_and_leave_the_cache(start, message):
    stock, (ours, _) = _stock(), _ours("int2")
    for i in range(3):
        k, v = _chunk(i, 0)
        _stock_update(stock, k, v, i * N, True)
        ours.update(k, v, i * N, sink_tokens=SINK, update_cache=True)
    before = (ours.end, ours.absolute_end, ours.last_start, ours.sink_end, ours.cache.resident_nbytes())
    k, v = _chunk(5, 0)
    with pytest.raises(ValueError, match=message):
        _stock_update(stock, k, v, start, True)
    with pytest.raises(ValueError, match=message):
        ours.update(k, v, start, sink_tokens=SINK, update_cache=True)
    assert (ours.end, ours.absolute_end, ours.last_start, ours.sink_end, ours.cache.resident_nbytes()) == before


def _within_codec_bound(got: torch.Tensor, want: torch.Tensor, bits: int) -> float:
    """Largest error / bound over packed chunks. The codec's per-element guarantee: half a
    step of the residual grid, the step being the block's residual absmax / q (q = 7 for
    int4's codes -7..7, 1 for int2's -1..1), its fp8 scale rounded by at most 1/8; the
    residual (x - centroid) is at most twice the chunk's absmax A over the block, the centroid
    being a mean of the chunk's tokens. So |error| <= A / q * (1 + 1/8)."""
    q = 7 if bits == 4 else 1
    worst = 0.0
    for c in range(0, want.shape[1], N):
        w, g = want[:, c:c + N].double(), got[:, c:c + N].double()
        amax = w.abs().amax(dim=(1, 3), keepdim=True)  # per head over the chunk (D = one block)
        worst = max(worst, float(((g - w).abs() / (amax / q * 1.125)).max()))
    return worst


@pytest.mark.parametrize("quant", ["int4", "int2"])
def test_qvg_views_keep_vllm_omnis_positions_dense_tokens_exact_packed_within_codec_bounds(quant):
    """Same visible length as stock every call; the chunks kept dense bit-exact; packed tokens within the codec's per-element bound; fewer bytes
    held than vLLM-Omni's preallocated buffers."""
    bits = int(quant[-1])
    stock, (ours, ledger) = _stock(), _ours(quant)
    worst, packed_calls = 0.0, 0
    for i, step, commit in _schedule(7):
        k, v = _chunk(i, step)
        want = _stock_update(stock, k, v, i * N, commit)
        got = ours.update(k, v, i * N, sink_tokens=SINK, update_cache=commit)
        assert got[0].shape == want[0].shape
        # dense: the chunk written now, the newest completed one (keep-recent 1) and, for a
        # probe, the chunk committed last (the cache's current chunk until the next commit);
        # never the sink chunk (packed: sink=True; the view's first SINK tokens once a second
        # chunk exists), whose tokens are checked against the bound
        visible = got[0].shape[1]
        if i == 0:
            exact = visible
        else:
            exact = min(visible - SINK, (i + 1) * N - max(SINK, (i - (1 if commit else 2)) * N))
        cut = visible - exact
        assert torch.equal(got[0][:, cut:], want[0][:, cut:])
        assert torch.equal(got[1][:, cut:], want[1][:, cut:])
        if cut:
            packed_calls += int(not torch.equal(got[0][:, :cut], want[0][:, :cut]))
            for g, w in zip(got, want):
                worst = max(worst, _within_codec_bound(g[:, :cut], w[:, :cut], bits))
    assert packed_calls > 0 and worst <= 1.0, worst
    dense = stock.key.nbytes + stock.value.nbytes
    assert ledger.dense_bytes == dense
    assert ours.cache.resident_nbytes() < dense


def test_probes_store_nothing():
    """A probe leaves bytes and cursors as they were; the commit after any number of probes
    returns what a commit without probes returns."""
    (a, _), (b, _) = _ours("int2"), _ours("int2")
    for i in range(5):
        k, v = _chunk(i, PROBES)
        state = (a.end, a.absolute_end, a.last_start, a.sink_end, a.cache.resident_nbytes())
        for step in range(PROBES):
            pk, pv = _chunk(i, step)
            a.update(pk, pv, i * N, sink_tokens=SINK, update_cache=False)
            assert (a.end, a.absolute_end, a.last_start, a.sink_end, a.cache.resident_nbytes()) == state
        ga = a.update(k, v, i * N, sink_tokens=SINK, update_cache=True)
        gb = b.update(k, v, i * N, sink_tokens=SINK, update_cache=True)
        assert torch.equal(ga[0], gb[0]) and torch.equal(ga[1], gb[1])


def test_requests_are_isolated():
    """Two requests' caches, interleaved call by call, give what each gives alone."""
    (alone, _), (x, _), (y, _) = _ours("int2"), _ours("int2"), _ours("int2")
    solo = []
    for i, step, commit in _schedule(5):
        k, v = _chunk(i, step)
        solo.append(alone.update(k, v, i * N, sink_tokens=SINK, update_cache=commit))
    j = 0
    for i, step, commit in _schedule(5):
        k, v = _chunk(i, step)
        kx, vx = _chunk(i + 50, step)
        gx = x.update(kx, vx, i * N, sink_tokens=SINK, update_cache=commit)
        gy = y.update(k, v, i * N, sink_tokens=SINK, update_cache=commit)
        assert torch.equal(gy[0], solo[j][0]) and torch.equal(gy[1], solo[j][1])
        assert not torch.equal(gx[0], gy[0])
        j += 1


def test_a_head_shard_packs_its_heads_as_one_process_packs_them():
    """Ulysses/TP: a rank caching head 1 of 2 (head_offset=1) holds exactly head 1 of the
    whole-cache run (the codec keys each head's k-means by its global index)."""
    (whole, _), (shard, _) = _ours("int2"), _ours("int2", heads=1, head_offset=1)
    for i, step, commit in _schedule(6):
        k, v = _chunk(i, step)
        gw = whole.update(k, v, i * N, sink_tokens=SINK, update_cache=commit)
        gs = shard.update(k[:, :, 1:].contiguous(), v[:, :, 1:].contiguous(), i * N,
                          sink_tokens=SINK, update_cache=commit)
        assert torch.equal(gs[0], gw[0][:, :, 1:]) and torch.equal(gs[1], gw[1][:, :, 1:])


class _Allocations(TorchDispatchMode):
    """Bytes of the new storages the ops run under it create (an output sharing no input's
    storage is new memory; views and in-place copies are not). An upper bound on the call's
    peak transient: reaching it with tensors still alive at return proves the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                inputs.add(t.untyped_storage().data_ptr())
                self.nbytes += t.untyped_storage().nbytes()
        return out


def _visible_positions(i: int) -> tuple[tuple[int, int], ...]:
    """The oracle, from positions only: what chunk ``i`` (a probe or its commit) sees, as
    vLLM-Omni's cache keeps it: the sink (the first SINK tokens), the newest older tokens that
    fit beside the sink and the chunk in CAP, the chunk."""
    if i == 0:
        return ((0, N),)
    local = min(i * N - SINK, CAP - SINK - N)
    return ((0, SINK), (i * N - local, i * N), (i * N, (i + 1) * N))


@pytest.mark.parametrize("quant", ["off", "int4", "int2"])
def test_the_peak_counts_every_probes_kv_and_the_probe_builds_nothing_else(quant):
    """The logged peak (`KVLedger.peak_nbytes`, all layers) against an oracle: per call, the
    stores' resident bytes plus the visible K/V ``[B, visible, H, D]`` of that call, visible
    counted from positions (`_visible_positions`; with quantization off the resident bytes
    are counted from positions too: every held token dense). And each probe
    (``update_cache=False``) allocates that visible K/V and no other K/V (measured with
    `_Allocations`): the history it reads, the packed part decoded, goes straight into the
    returned buffer. With quantization off that is every byte it allocates; packed history
    adds the codec's decode work (less than one dense chunk here), which the peak does not
    count, as the store's own ``peak_transient_nbytes`` counts the buffer it fills."""
    per_token = 2 * B * H * D * 4  # K and V, float32
    spec = CausalCacheSpec(batch_size=B, num_heads=H, head_dim=D, cache_size=CAP,
                           sink_tokens=SINK, dtype=torch.float32, device="cpu")
    layers, ledger = allocate_layers(spec, QVGKVQuantArgs.from_codec_name(quant), num_layers=2)
    want_peak, probes = 0, 0
    for i, step, commit in _schedule(7):
        for layer in layers:
            k, v = _chunk(i, step)
            with _Allocations() as built:
                got = layer.update(k, v, i * N, sink_tokens=SINK, update_cache=commit)
            visible = sum(b - a for a, b in _visible_positions(i)) * per_token
            assert got[0].nbytes + got[1].nbytes == visible
            if not commit and i > 0:
                if quant == "off":
                    assert built.nbytes == visible, (i, step, built.nbytes, visible)
                else:  # plus the codec's own decode work (per packed chunk), not K/V
                    assert visible <= built.nbytes < visible + N * per_token, (i, step, built.nbytes)
                probes += 1
            resident = ledger.resident_nbytes
            if quant == "off":  # every held token dense: layers up to this one hold chunk i now
                j = layers.index(layer)
                held = [_visible_positions(i) if commit and m <= j else
                        (_visible_positions(i - 1) if i else ()) for m in range(len(layers))]
                resident = sum(b - a for pos in held for a, b in pos) * per_token
                assert resident == ledger.resident_nbytes
            want_peak = max(want_peak, resident + visible)
    assert probes == 2 * 6 * PROBES
    assert ledger.peak_nbytes == want_peak
    assert ledger.peak_transient_nbytes == sum(b - a for a, b in _visible_positions(6)) * per_token
