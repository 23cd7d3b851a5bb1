"""The QVG packed cache against the dense cache and the oracle, on the same random sequences.

- Quantization off: every view (positions, cursors, k, v) is bit-for-bit the dense cache's,
  and errors match, for 2,000 sequences (profile ``ci``), plus the oracle directly.
- Quantization on: positions, cursors, errors and ``global_end`` still equal the dense
  cache's; k/v stay finite and shaped like the dense ones; and no position is ever packed
  twice within a stream (each ``_pack`` call is recorded and checked for overlap).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from oracle import (
    OracleCache,
    OracleError,
    apply_to_cache,
    apply_to_oracle,
    assert_caches_agree,
    cursors,
    examples,
    resolve,
    run_sequence,
    scenarios,
)

from causalkv.caches import DenseCausalKVCache, KVCacheSpec
from causalkv.caches.qvg.args import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache

PARITY_SEQUENCES = examples(2000)


def packed_off(spec: KVCacheSpec) -> QVGPackedCausalKVCache:
    return QVGPackedCausalKVCache(spec, QVGKVQuantArgs())


@settings(max_examples=PARITY_SEQUENCES)
@given(scenarios())
def test_packed_quant_off_equals_dense_bit_for_bit(scenario):
    spec, ops = scenario
    assert_caches_agree(DenseCausalKVCache, packed_off, spec, ops)


@settings(max_examples=examples(300))
@given(scenarios(dtype=torch.bfloat16))
def test_packed_quant_off_matches_oracle_bf16(scenario):
    spec, ops = scenario
    run_sequence(packed_off, spec, ops, check_resident_nbytes=False)


class _RecordingPacked(QVGPackedCausalKVCache):
    """Records every packed run per stream and fails on a position packed twice."""

    def __init__(self, spec, quant):
        super().__init__(spec, quant)
        self.packed_runs: list[tuple[int, int]] = []

    def _pack(self, pieces):
        seg = super()._pack(pieces)
        for a, b in self.packed_runs:
            assert seg.end <= a or seg.start >= b, f"[{seg.start},{seg.end}) packed twice"
        self.packed_runs.append((seg.start, seg.end))
        return seg

    def reset_indices(self):
        super().reset_indices()
        self.packed_runs = []


@settings(max_examples=examples(400))
@given(scenarios(max_ops=32))
def test_packed_quant_on_positions_equal_dense_and_never_repacks(scenario):
    spec, ops = scenario
    quant = QVGKVQuantArgs(bits=2, centroids=4, block_size=4, keep_recent_chunks=0)
    dense, packed = DenseCausalKVCache(spec), _RecordingPacked(spec, quant)
    tracker = OracleCache.from_spec(spec)
    for step, op in enumerate(ops):
        where = f"op {step} {op}"
        call = resolve(op, tracker, wid=step + 1)
        try:
            apply_to_oracle(tracker, call)
        except OracleError:
            pass
        results = []
        for cache in (dense, packed):
            try:
                results.append((apply_to_cache(cache, spec, call), None))
            except ValueError as e:
                results.append((None, e))
        (rd, ed), (rp, ep) = results
        assert type(ed) is type(ep), f"{where}: errors differ: {ed!r} vs {ep!r}"
        if ed is None and call.kind in ("write", "read"):
            assert torch.equal(rd.positions, rp.positions), f"{where}: positions"
            assert cursors(rd) == cursors(rp), f"{where}: cursors"
            assert rp.k.shape == rd.k.shape and rp.k.dtype == rd.k.dtype, where
            assert torch.isfinite(rp.k).all() and torch.isfinite(rp.v).all(), where
        elif ed is None and call.kind == "can_direct":
            assert rd == rp, where
        assert dense.global_end == packed.global_end, where
    assert packed.quantize_calls >= len(packed.packed_runs)
