"""The codec's device path (what `quantize` runs on a GPU) exercised on the CPU.

On any device but the CPU, `quantize` must make no host sync: no ``.tolist()`` / ``.item()``
of a device tensor, no k-means draws on the host per call. Here the device path is forced
on CPU tensors (`quantizer._host_checked` answers False) with ``Tensor.tolist`` / ``.item`` made
to fail, and its bytes are compared with the CPU path's (the oracle: the host path the
codec tests pin), including exponents outside float32's normal range. A head with NaN/inf
cannot be refused without a sync: it must come back poisoned (decoding to non-finite values)
while the other heads are the CPU path's bytes. Views of a segment (`select_heads`,
`select_tokens`) decode exactly like the same part of the whole.
"""

from __future__ import annotations

import pytest
import torch

from causalkv.caches.codecs.prq import dequantize, quantize, quantizer
from causalkv.caches.codecs.prq.format import POISON_SCALE_EXP
from causalkv.caches.qvg import QVGKVQuantArgs

ARGS = [
    QVGKVQuantArgs(codec="int2", centroids=8, block_size=16),
    QVGKVQuantArgs(codec="int4", centroids=16, block_size=32, stages=2),
    QVGKVQuantArgs(codec="int2", centroids=4, block_size=16, asymmetric=True),
    QVGKVQuantArgs(codec="int4", centroids=8, block_size=16, grid="mse4"),
]


def _tensors(p):
    out = [*p.centroids, *p.ids, p.codes, p.scales.view(torch.uint8), p.scale_exp]
    return out + ([p.zeros] if p.zeros is not None else [])


def _same_bytes(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b), strict=True))


def _sync(*args, **kwargs):
    raise AssertionError("host sync in the device path")


@pytest.fixture
def device_path(monkeypatch):
    """Run `quantize` as on a GPU: no host read of device values allowed."""
    monkeypatch.setattr(quantizer, "_host_checked", lambda device: False)
    monkeypatch.setattr(torch.Tensor, "tolist", _sync)
    monkeypatch.setattr(torch.Tensor, "item", _sync)


def _inputs():
    g = torch.Generator().manual_seed(0)
    for dtype, tiny in ((torch.bfloat16, 1e-30), (torch.float32, 1e-30), (torch.float16, 1e-3),
                        (torch.float64, 1e-30)):
        x = (torch.randn(2, 3, 100, 64, generator=g) * 3).to(dtype)
        x[0, 1] *= tiny  # one head far below the others: its own exponent
        yield dtype, x
    yield "float32 subnormal", torch.randn(1, 2, 64, 64, generator=g) * 1e-42  # 2**-e > float32 max
    yield "float64 huge", torch.randn(1, 2, 64, 64, generator=g, dtype=torch.float64) * 1e300


@pytest.mark.parametrize("args", ARGS, ids=["int2", "int4-2stage", "int2-asym", "int4-mse4"])
def test_device_path_gives_the_cpu_paths_bytes_without_a_sync(args, monkeypatch):
    cases = list(_inputs())
    want = [quantize(x, args, seed=5, head_offset=2) for _, x in cases]
    book = quantize(cases[0][1], args, seed=5)  # a codebook to assign to
    want_book = quantize(cases[0][1] * 0.5, args, codebooks=book.centroids)

    monkeypatch.setattr(quantizer, "_host_checked", lambda device: False)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", _sync)
        m.setattr(torch.Tensor, "item", _sync)
        got = [quantize(x, args, seed=5, head_offset=2) for _, x in cases]
        got_book = quantize(cases[0][1] * 0.5, args, codebooks=book.centroids)
    for (name, _), a, b in zip(cases, want, got, strict=True):
        assert _same_bytes(a, b), name
    assert _same_bytes(want_book, got_book)


def test_kmeans_draws_are_computed_once_per_geometry(device_path):
    quantizer.kmeans_draws.cache_clear()
    x = torch.randn(1, 2, 300, 32).to(torch.bfloat16)
    q = QVGKVQuantArgs(codec="int2", centroids=8, block_size=16)
    for i in range(3):
        quantize(x * (i + 1), q)
    info = quantizer.kmeans_draws.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_poisoned_heads_decode_to_non_finite_values(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 64, 32, generator=g)
    x[0, 1, 3, 4] = float("nan")
    x[0, 2, 9, 0] = float("inf")
    q = QVGKVQuantArgs(codec="int2", centroids=4, block_size=16)
    with pytest.raises(ValueError, match="2 non-finite"):  # the CPU path refuses it
        quantize(x, q)
    monkeypatch.setattr(quantizer, "_host_checked", lambda device: False)
    with monkeypatch.context() as m:  # no raise, and no host read of a device value
        m.setattr(torch.Tensor, "tolist", _sync)
        m.setattr(torch.Tensor, "item", _sync)
        p = quantize(x, q)
    assert p.scale_exp[0].tolist() == [p.scale_exp[0, 0].item(), POISON_SCALE_EXP,
                                       POISON_SCALE_EXP]
    out = dequantize(p, dtype=torch.float32)
    assert not torch.isfinite(out[0, 1:]).any()
    clean = quantize(x[:, :1], q)  # head 0 alone, on the host path: the same bytes
    assert torch.equal(out[0, :1], dequantize(clean, dtype=torch.float32)[0])


@pytest.mark.parametrize("args", ARGS, ids=["int2", "int4-2stage", "int2-asym", "int4-mse4"])
def test_head_and_token_views_decode_like_the_whole(args):
    x = torch.randn(2, 3, 70, 64).to(torch.bfloat16)
    p = quantize(x, args)
    for dtype in (torch.float32, torch.bfloat16):
        whole = dequantize(p, dtype=dtype)
        for h0, h1, a, b in ((0, 3, 5, 33), (1, 2, 0, 70), (1, 3, 69, 70), (0, 1, 0, 1)):
            part = p.select_heads(h0, h1).select_tokens(a, b)
            assert part.shape == (2, h1 - h0, b - a, 64)
            assert torch.equal(dequantize(part, dtype=dtype), whole[:, h0:h1, a:b])
            big = torch.zeros(2, 80, h1 - h0, 64, dtype=dtype)
            window = big[:, 3 : 3 + b - a].permute(0, 2, 1, 3)
            dequantize(part, out=window)
            assert torch.equal(window, whole[:, h0:h1, a:b])
            assert not big[:, :3].any() and not big[:, 3 + b - a :].any()
    with pytest.raises(ValueError, match="select_tokens"):
        p.select_tokens(5, 5)
    assert p.select_tokens(0, 70) is p
