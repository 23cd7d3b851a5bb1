"""The core driven through the host contract alone (docs/hosts.md) by a toy host in one module
(tests/toy_host.py): probes, commits, a pin after a scene cut, head slices, reset and a second
request.

Oracle: the same host on the dense cache with every write unmarked (the contract's reference
answers). Quantization off gives every view bit for bit. int2 gives the same positions, the
chunk's own rows exactly, and history equal bit for bit to the same packed cache driven with
no marks (the same chunks packed by the same codec: marking changes when, never what), all
at fewer bytes than the dense cache holds.
"""

from __future__ import annotations

import pytest
import torch
import toy_host as toy

from causalkv.caches.qvg import QVGKVQuantArgs

REQUESTS = [toy.Request(chunks=7, cuts=(3,)), toy.Request(chunks=5, cuts=(1,))]
LAYERS = 3


@pytest.fixture(scope="module")
def dense() -> toy.Trace:
    return toy.run(REQUESTS, layers=LAYERS, quant=None)


def test_quant_off_answers_every_call_bit_for_bit(dense):
    got = toy.run(REQUESTS, layers=LAYERS, quant=QVGKVQuantArgs())
    assert got.views.keys() == dense.views.keys()
    for key, (k, v, pos) in got.views.items():
        want_k, want_v, want_pos = dense.views[key]
        assert pos == want_pos, key
        assert torch.equal(k, want_k) and torch.equal(v, want_v), key
    # probes hold nothing and the commit keeps only what the next chunk reads: less than the
    # dense cache's preallocated buffers at the peak, with no codec at all (one chunk of one
    # layer less per layer: 3 layers x 3 chunks + the layer being committed, against 3 x 4)
    chunk = 2 * toy.N * toy.H * toy.D * 2
    assert dense.peak_resident_bytes == LAYERS * 4 * chunk
    assert got.peak_resident_bytes == (LAYERS * 3 + 1) * chunk


@pytest.mark.parametrize("keep_recent", [0, 1])
def test_int2_keeps_positions_and_the_chunks_own_rows(dense, keep_recent: int):
    q = QVGKVQuantArgs(codec="int2", block_size=16, keep_recent_chunks=keep_recent)
    got = toy.run(REQUESTS, layers=LAYERS, quant=q)
    unmarked = toy.run(REQUESTS, layers=LAYERS, quant=q, marked=False)
    differs = 0
    for key, (k, v, pos) in got.views.items():
        want_k, want_v, want_pos = dense.views[key]
        assert pos == want_pos, key
        n = toy.N  # the chunk being written is the view's last N rows, never packed
        assert torch.equal(k[:, -n:], want_k[:, -n:]) and torch.equal(v[:, -n:], want_v[:, -n:])
        same_k, same_v, _ = unmarked.views[key]
        assert torch.equal(k, same_k) and torch.equal(v, same_v), key
        differs += not torch.equal(k, want_k)
    assert differs > 0  # history was packed
    assert got.peak_resident_bytes < unmarked.peak_resident_bytes < dense.peak_resident_bytes


def test_unmarked_writes_keep_the_dense_semantics(dense):
    got = toy.run(REQUESTS, layers=LAYERS, quant=QVGKVQuantArgs(), marked=False)
    for key, (k, v, pos) in got.views.items():
        want_k, want_v, want_pos = dense.views[key]
        assert pos == want_pos and torch.equal(k, want_k) and torch.equal(v, want_v), key


def test_the_host_contract_lists_the_cursor_protocol_as_the_code_declares_it():
    """docs/hosts.md, "Its cursor as positions": the calls it lists are every member of
    `PositionModel` (what a new cursor model implements), each with as many arguments as the
    protocol's method takes."""
    import inspect
    import re
    from pathlib import Path

    from causalkv.caches.positions import PositionModel

    text = (Path(__file__).resolve().parents[1] / "docs" / "hosts.md").read_text()
    item = re.search(r"1\. \*\*Its cursor as positions\.\*\*(.*?)\n2\. ", text, re.S).group(1)
    listed = {m[1]: [a for a in m[2].split(",") if a.strip()]
              for m in re.finditer(r"`(\w+)\(([^)`]*)\)`", item)}
    declared = {name: [p for p in inspect.signature(getattr(PositionModel, name)).parameters
                       if p != "self"]
                for name in vars(PositionModel) if not name.startswith("_")}
    assert set(listed) == set(declared), (sorted(listed), sorted(declared))
    for name, params in declared.items():
        assert len(listed[name]) == len(params), (name, listed[name], params)
