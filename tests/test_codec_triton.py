"""Every Triton kernel of the PRQ codec against the PyTorch path, on the CPU (TRITON_INTERPRET=1).

``TRITON_INTERPRET`` only takes effect if it is set before triton is first imported, and it
must not leak into other test modules of the same worker. So, in a normal run, this module
holds one test that re-runs this very file in a fresh interpreter with
``TRITON_INTERPRET=1``; there (and only there) the kernel-by-kernel cases are defined.
Shapes stay small: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import INTERPRETED, run_interpreted

from causalkv.caches.codecs.prq import dequantize, quantize
from causalkv.caches.codecs.prq import torch_impl as ti
from causalkv.caches.qvg import QVGKVQuantArgs

BF16_ULP = 2.0**-7  # bf16 spacing relative to the value's power of two


if not INTERPRETED:

    def test_triton_kernels_under_the_interpreter():
        run_interpreted(__file__)


if INTERPRETED:  # the cases, run only in the interpreted child process

    @pytest.fixture(scope="module")
    def tr():
        from causalkv.caches.codecs.prq import triton_impl

        return triton_impl


    def _data(BH=3, S=70, D=48, seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(BH, S, D, generator=g)


    def test_assign_kernel_matches_torch(tr):
        x = _data()
        c = x[:, :20].clone() + 0.01
        want = ti.kmeans_assign(x, c)
        got = tr.kmeans_assign(x, c)
        assert got.dtype == torch.int64 and got.shape == want.shape
        # same nearest centroid, or (summation-order near-tie) an equally near one
        d = ((x.unsqueeze(2) - c.unsqueeze(1)) ** 2).sum(-1)  # [BH, S, K]
        dg = torch.gather(d, 2, got.unsqueeze(-1)).squeeze(-1)
        dw = torch.gather(d, 2, want.unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(dg, dw, rtol=1e-5, atol=1e-5)
        assert (got == want).float().mean() > 0.99


    def test_update_kernel_matches_torch_and_keeps_empty_clusters(tr):
        x = _data(S=90)
        c = torch.randn(3, 20, 48) * 5
        ids = ti.kmeans_assign(x, c[:, :12])  # clusters 12..19 stay empty
        want = ti.kmeans_update(x, ids, c)
        got = tr.kmeans_update(x, ids, c)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(got[:, 12:], c[:, 12:])


    @pytest.mark.parametrize(
        "bits,block,grid,asym",
        [(2, 16, "reference", False), (4, 16, "reference", False), (2, 16, "mse4", False),
         (4, 24, "mse4", False), (2, 8, "reference", True), (4, 16, "reference", True)],
    )
    def test_quantize_pack_kernel_matches_torch(tr, bits, block, grid, asym):
        g = torch.Generator().manual_seed(bits * 100 + block)
        N, D = 50, 48
        r = torch.randn(N, D, generator=g)
        scale = torch.rand(N, D // block, generator=g) * 0.8 + 0.05
        scale[3, 0] = 0.0  # a zero block scale: codes 0
        zeros = (torch.randint(-3, 3, (N, D // block), generator=g).to(torch.int8) if asym else None)
        want = ti.quantize_pack(r, scale, zeros, bits=bits, block=block, grid=grid)
        got = tr.quantize_pack(r, scale, zeros, bits=bits, block=block, grid=grid)
        assert torch.equal(got, want)


    @pytest.mark.parametrize(
        "args",
        [QVGKVQuantArgs(codec="int2", centroids=16, block_size=16),
         QVGKVQuantArgs(codec="int4", centroids=16, block_size=24, grid="mse4"),
         QVGKVQuantArgs(codec="int2", centroids=8, block_size=16, asymmetric=True),
         QVGKVQuantArgs(codec="int2", centroids=8, block_size=8, stages=2)],
        ids=["int2", "int4-mse4", "int2-asym", "int2-2stage"],
    )
    def test_fused_dequantize_kernel_matches_torch(tr, args):
        x = torch.randn(2, 2, 40, 48).to(torch.bfloat16)
        x[0, 1, 3, :args.block_size] = 0  # an all-zero input block
        p = quantize(x, args, backend="torch")
        want32 = dequantize(p, dtype=torch.float32, backend="torch")
        got32 = dequantize(p, dtype=torch.float32, backend="triton")
        assert torch.allclose(got32, want32, rtol=2.0**-22, atol=0)  # both: fp32 c + level * s
        assert (got32[0, 1, 3, :args.block_size] == 0).all()
        # bf16: the interpreter's float32 -> bf16 cast truncates where the GPU rounds: <= 1 ulp
        got = dequantize(p, backend="triton")
        assert ((got.float() - want32).abs() <= want32.abs() * BF16_ULP).all()
        big = torch.full((2, 50, 2, 48), 3.0, dtype=torch.float32)
        view = big.permute(0, 2, 1, 3)[:, :, 5:45]
        assert dequantize(p, out=view, backend="triton") is view
        assert torch.equal(view, got32)
        assert (big[:, :5] == 3).all() and (big[:, 45:] == 3).all()


    @pytest.mark.parametrize(
        "args",
        [QVGKVQuantArgs(codec="int2", centroids=16, block_size=16),
         QVGKVQuantArgs(codec="int2", centroids=8, block_size=16, asymmetric=True),
         QVGKVQuantArgs(codec="int2", centroids=8, block_size=8, stages=2)],
        ids=["int2", "int2-asym", "int2-2stage"],
    )
    def test_fused_dequantize_reads_head_and_token_slices_in_place(tr, args):
        """A head and token slice of a segment (views: strided codes, scales, zeros, ids)
        decodes like the same part of the whole segment, into a strided window."""
        x = torch.randn(2, 3, 40, 48).to(torch.bfloat16)
        p = quantize(x, args, backend="torch")
        whole = dequantize(p, dtype=torch.float32, backend="torch")
        for h0, h1, a, b in ((0, 3, 5, 33), (1, 2, 0, 40), (1, 3, 39, 40)):
            part = p.select_heads(h0, h1).select_tokens(a, b)
            assert not part.codes.is_contiguous() or (h1 - h0, b - a) == (1, 40)
            big = torch.full((2, 50, h1 - h0, 48), 3.0)
            view = big[:, 4 : 4 + b - a].permute(0, 2, 1, 3)
            dequantize(part, out=view, backend="triton")
            assert torch.allclose(view, whole[:, h0:h1, a:b], rtol=2.0**-22, atol=0)
            assert (big[:, :4] == 3).all() and (big[:, 4 + b - a :] == 3).all()


    def test_poisoned_head_decodes_to_nan_like_the_torch_path(tr):
        """A head stored with `POISON_SCALE_EXP` (non-finite input on the sync-free device
        path) decodes to non-finite values in the kernel too; the other heads are untouched."""
        from causalkv.caches.codecs.prq.format import POISON_SCALE_EXP

        x = torch.randn(1, 3, 40, 48).to(torch.bfloat16)
        x[0, 1, :5] = 0  # zero blocks in the poisoned head must not decode to exact zeros
        p = quantize(x, QVGKVQuantArgs(codec="int2", centroids=8, block_size=16), backend="torch")
        want = dequantize(p, dtype=torch.float32, backend="torch")
        p.scale_exp[0, 1] = POISON_SCALE_EXP
        got = dequantize(p, dtype=torch.float32, backend="triton")
        assert torch.isnan(got[0, 1]).all()
        assert not torch.isfinite(dequantize(p, dtype=torch.float32, backend="torch")[0, 1]).any()
        assert torch.allclose(got[0, [0, 2]], want[0, [0, 2]], rtol=2.0**-22, atol=0)


    def test_dequantize_decodes_every_scale_byte_like_the_table(tr):
        """Every e4m3 scale byte under per-head exponents at both ends of the range decodes
        in the kernel to exactly `scale_table` (float64 product rounded once); 0x80 and the
        NaN bytes give 0. Level 1 on zero centroids isolates the decoded scale."""
        from causalkv.caches.codecs.prq.format import PackedSegment, scale_table

        exps = [-100, -3, 0, 119]
        H, S, D = len(exps), 256, 16
        p = PackedSegment(
            centroids=[torch.zeros(1, H, 2, D, dtype=torch.bfloat16)],
            ids=[torch.zeros(1, H, S, dtype=torch.uint8)],
            codes=torch.full((1, H, S, D // 2), 0x11, dtype=torch.uint8),  # every field v=1
            scales=torch.arange(S, dtype=torch.int32).to(torch.uint8).repeat(1, H, 1)
            .view(1, H, S, 1).view(torch.float8_e4m3fn),
            zeros=None, scale_exp=torch.tensor([exps], dtype=torch.int16), shape=(1, H, S, D),
            dtype=torch.float32, bits=4, block_size=D,
        )
        got = dequantize(p, dtype=torch.float32, backend="triton")
        want = scale_table(p.scale_exp, torch.device("cpu")).view(1, H, S, 1).expand(1, H, S, D)
        assert torch.equal(got, want)
        assert (got[:, :, 0x80] == 0).all() and (got[:, :, 0x7F] == 0).all()


    def test_triton_quantize_end_to_end_matches_torch(tr):
        """Same seed, same init: the Triton pipeline reproduces the PyTorch one (up to the rare
        float summation near-tie) and is itself deterministic."""
        g = torch.Generator().manual_seed(5)
        x = (torch.randn(1, 2, 64, 32, generator=g) * 2).to(torch.bfloat16)
        args = QVGKVQuantArgs(codec="int2", centroids=16, block_size=16, grid="mse4")
        pt = quantize(x, args, backend="torch")
        pa = quantize(x, args, backend="triton")
        pb = quantize(x, args, backend="triton")
        assert torch.equal(pa.codes, pb.codes) and torch.equal(pa.ids[0], pb.ids[0])
        assert (pa.ids[0] == pt.ids[0]).float().mean() > 0.95
        assert (pa.codes == pt.codes).float().mean() > 0.95
        yt = dequantize(pt, dtype=torch.float32).double()
        ya = dequantize(pa, dtype=torch.float32, backend="triton").double()
        x64 = x.double()
        et, ea = (yt - x64).norm() / x64.norm(), (ya - x64).norm() / x64.norm()
        assert abs(float(ea - et)) <= 0.02 * float(et)


    def test_env_var_forces_the_backend(tr, monkeypatch):
        x = torch.randn(1, 1, 20, 16).to(torch.bfloat16)
        args = QVGKVQuantArgs(codec="int4", centroids=4, block_size=16)
        monkeypatch.setenv("CAUSALKV_QVG_BACKEND", "triton")
        calls = []
        real = tr.dequantize_into
        monkeypatch.setattr(tr, "dequantize_into", lambda p, o: (calls.append(1), real(p, o)))
        p = quantize(x, args)
        dequantize(p)
        assert calls == [1]


    @pytest.mark.parametrize(
        "args",
        [QVGKVQuantArgs(codec="int2", centroids=4, block_size=16),  # Lloyd on a sample (S > 32 K)
         QVGKVQuantArgs(codec="int4", centroids=8, block_size=16, grid="mse4", stages=2),
         QVGKVQuantArgs(codec="int2", centroids=4, block_size=8, asymmetric=True)],
        ids=["int2-sampled", "int4-mse4-2stage", "int2-asym"],
    )
    @pytest.mark.parametrize("batched", [False, True], ids=["per-head", "all-heads"])
    def test_triton_head_slices_equal_the_whole(tr, args, batched, monkeypatch):
        """head_offset under the Triton backend, with heads one at a time (the CPU grouping)
        and all heads in one launch (the CUDA grouping): bytes equal the whole tensor's."""
        from causalkv.caches.codecs.prq import quantizer

        monkeypatch.setattr(quantizer, "_head_group", lambda device, n, S: n if batched else 1)
        g = torch.Generator().manual_seed(8)
        x = torch.randn(1, 3, 160, 32, generator=g)
        x = (x * torch.tensor([2.0**-5, 1.0, 2.0**7]).view(1, 3, 1, 1)).to(torch.bfloat16)
        whole = quantize(x, args, seed=3, backend="triton")
        y = dequantize(whole, dtype=torch.float32, backend="triton")
        for a, b in [(0, 1), (1, 2), (2, 3), (1, 3)]:
            part = quantize(x[:, a:b], args, seed=3, head_offset=a, backend="triton")
            sub = whole.select_heads(a, b)
            assert torch.equal(part.scale_exp, sub.scale_exp)
            assert torch.equal(part.codes, sub.codes)
            assert torch.equal(part.scales.view(torch.uint8), sub.scales.view(torch.uint8))
            for pi, si in zip(part.ids, sub.ids):
                assert torch.equal(pi, si)
            for pc, sc in zip(part.centroids, sub.centroids):
                assert torch.equal(pc, sc)
            if args.asymmetric:
                assert torch.equal(part.zeros, sub.zeros)
            assert torch.equal(dequantize(part, dtype=torch.float32, backend="triton"), y[:, a:b])


    def test_gpu_benchmark_script_runs_its_checks_on_the_cpu(tmp_path):
        """benchmarks/gpu_codec.py (the GPU check, prepared for a CUDA machine) runs its
        backend checks and timing loop end to end under the interpreter and writes its JSON."""
        import importlib.util
        import json
        from pathlib import Path

        path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_codec.py"
        spec = importlib.util.spec_from_file_location("gpu_codec", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out = tmp_path / "gpu.json"
        assert mod.main(["--device", "cpu", "--smoke", "--json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["schema"] == "causalkv.gpu-codec-bench/1" and res["ok"]
        assert {c["name"] for c in res["checks"]} == set(mod.CHECK_ARGS)
        assert all(c["head_offset_bitwise"] and c["dequant_f32_max_rel"] <= 2.0**-20
                   for c in res["checks"])
        assert [(t["bits"], t["shape"]) for t in res["throughput"]] == [(2, [1, 2, 64, 64]),
                                                                        (4, [1, 2, 64, 64])]
        assert all(t["dequant_ms"] > 0 and t["copy_ms"] > 0 for t in res["throughput"])
        assert mod.main(["--device", "cuda"]) == 2 or __import__("torch").cuda.is_available()
