"""The PRQ codec's layers: a format leaf, two backends behind one protocol, a driver on top.

- No import cycle among the modules of ``causalkv.caches.codecs.prq`` (nor of
  ``causalkv.caches.qvg``, the store over it) and no import inside a function of the codec's
  modules (the edges are read from the source, so a future change that brings a loop back,
  or hides one in a function, fails here).
- Both backends implement `format.PRQKernels` with the protocol's very signatures.
- The codec reads only its own settings (`format.CodecSettings`): an object holding just those
  seven attributes packs the very bytes a `QVGKVQuantArgs` does, and counts the same bytes.
- Without triton the codec still imports and packs (the PyTorch backend, byte for byte what
  it packs with triton installed), and asking for the Triton backend is a `ConfigError`.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from causalkv.caches.codecs.prq import (
    dequantize,
    format,
    quantize,
    torch_impl,
    triton_impl,
)
from causalkv.caches.qvg import QVGKVQuantArgs

PRQ = Path(format.__file__).parent
QVG = PRQ.parents[1] / "qvg"
CODEC_MODULES = ("quantizer", "format", "workspace", "torch_impl", "triton_impl")


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks (imports for type checkers
    only are not import edges)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _causalkv_imports(tree: ast.AST, package: str) -> set[str]:
    """Every ``causalkv`` module ``tree`` imports at run time (``from pkg import sub`` counts
    as ``pkg.sub`` when ``sub`` is a module of ``package``)."""
    out: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("causalkv")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("causalkv"):
            if node.module == package:
                out |= {f"{package}.{a.name}" for a in node.names}
            else:
                out.add(node.module)
    return out


def _graph(package: str = "causalkv.caches.codecs.prq", folder: Path = PRQ) -> dict[str, set[str]]:
    mods = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    return {
        name: _causalkv_imports(ast.parse(path.read_text()), package) & set(mods)
        for name, path in mods.items()
    }


@pytest.mark.parametrize("package, folder", [("causalkv.caches.codecs.prq", PRQ),
                                             ("causalkv.caches.qvg", QVG)])
def test_no_import_cycle_among_the_modules(package: str, folder: Path):
    graph = _graph(package, folder)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, "import cycle: " + " -> ".join([*path[path.index(node):], node])
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


def test_the_format_is_a_leaf_and_the_backends_import_no_driver():
    graph = {k.rsplit(".", 1)[1]: {m.rsplit(".", 1)[1] for m in v} for k, v in _graph().items()}
    assert graph["format"] == set() and graph["workspace"] == set()
    assert graph["torch_impl"] <= {"format", "workspace"}
    assert graph["triton_impl"] <= {"format", "workspace"}
    assert {"torch_impl", "triton_impl", "format"} <= graph["quantizer"]


def test_the_codec_modules_import_nothing_inside_functions():
    for stem in CODEC_MODULES:
        tree = ast.parse((PRQ / f"{stem}.py").read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not inner, f"{stem}.py: {fn.name}() imports at line {inner[0].lineno}"


def _params(fn) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != "self"]


def test_both_backends_implement_the_protocol():
    methods = [n for n, v in vars(format.PRQKernels).items() if inspect.isfunction(v) and n[0] != "_"]
    assert sorted(methods) == ["dequantize_into", "kmeans_assign", "kmeans_update", "quantize_pack"]
    for module in (torch_impl, triton_impl):
        for name in methods:
            assert _params(getattr(module, name)) == _params(getattr(format.PRQKernels, name)), (
                f"{module.__name__}.{name}"
            )


CODEC_FIELDS = ("bits", "centroids", "block_size", "stages", "kmeans_iters", "asymmetric", "grid")


def test_the_codec_reads_only_its_own_settings():
    full = QVGKVQuantArgs(codec="int4", centroids=8, block_size=16, stages=2, asymmetric=True,
                          keep_recent_chunks=3, span_chunks=2, codebook_chunks=2, sink=False)
    only = SimpleNamespace(**{f: getattr(full, f) for f in CODEC_FIELDS})
    x = torch.linspace(-2, 2, 2 * 3 * 24 * 32).reshape(2, 3, 24, 32).cos()
    a = quantize(x, full, seed=3, head_offset=1, backend="torch")
    b = quantize(x, only, seed=3, head_offset=1, backend="torch")
    for ta, tb in [(a.codes, b.codes), (a.scale_exp, b.scale_exp), (a.zeros, b.zeros),
                   (a.scales.view(torch.uint8), b.scales.view(torch.uint8)),
                   *zip(a.ids, b.ids), *zip(a.centroids, b.centroids)]:
        assert torch.equal(ta, tb)
    again = quantize(x, only, seed=3, head_offset=1, codebooks=b.centroids, backend="torch")
    assert again.centroids[0] is b.centroids[0]
    assert torch.equal(dequantize(a, dtype=torch.float32), dequantize(b, dtype=torch.float32))
    assert format.packed_nbytes_formula((2, 3, 24, 32), only) == b.nbytes
    assert format.bits_per_element(24, 32, only) == format.bits_per_element(24, 32, full)


def _digests(x: torch.Tensor) -> tuple[str, str]:
    """sha256 of the packed bytes and of the float32 decode, both on the PyTorch backend."""
    p = quantize(x, QVGKVQuantArgs(codec="int2", centroids=8, block_size=16), seed=7, backend="torch")
    h = hashlib.sha256()
    for t in (p.codes, p.scales.view(torch.uint8), p.scale_exp, *p.ids, *p.centroids):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    y = dequantize(p, dtype=torch.float32, backend="torch")
    return h.hexdigest(), hashlib.sha256(y.numpy().tobytes()).hexdigest()


WITHOUT_TRITON = r"""
import hashlib, json, sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
from causalkv.caches.codecs.prq import dequantize, quantize, quantizer, triton_impl
from causalkv.caches.qvg import QVGKVQuantArgs
from causalkv.errors import ConfigError

x = torch.load(sys.argv[1])  # the parent's very bytes (see the test)
p = quantize(x, QVGKVQuantArgs(codec="int2", centroids=8, block_size=16), seed=7)
h = hashlib.sha256()
for t in (p.codes, p.scales.view(torch.uint8), p.scale_exp, *p.ids, *p.centroids):
    h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
refused = []
for call in (lambda: quantizer.resolve_backend("triton", torch.device("cpu")),
             lambda: dequantize(p, backend="triton")):
    try:
        call()
    except ConfigError as exc:
        refused.append(str(exc))
y = dequantize(p, dtype=torch.float32)
print(json.dumps({"available": triton_impl.AVAILABLE, "auto": quantizer.resolve_backend(None, torch.device("cpu")),
                  "digests": [h.hexdigest(), hashlib.sha256(y.numpy().tobytes()).hexdigest()],
                  "refused": refused}))
"""


def test_without_triton_the_codec_packs_the_same_bytes_and_refuses_the_triton_backend(tmp_path):
    # The input travels as a file: built in each process, `sin` is not reproducible across
    # processes on torch 2.13's CPU build (the first multi-threaded call of a vectorized math
    # function can return values up to 1.5e-4 off in the worker thread's half), and then the
    # two processes would be packing different tensors.
    x = torch.linspace(-3, 3, 1 * 2 * 40 * 32).reshape(1, 2, 40, 32).sin()
    torch.save(x, tmp_path / "x.pt")
    out = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, str(tmp_path / "x.pt")],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["available"] is False and got["auto"] == "torch"
    assert len(got["refused"]) == 2
    assert all("triton does not import" in r for r in got["refused"]), got["refused"]
    assert tuple(got["digests"]) == _digests(x)
