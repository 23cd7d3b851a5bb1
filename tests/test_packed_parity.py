"""The QVG packed cache against the dense cache and the oracle, on the same random sequences.

- Quantization off: every view (positions, cursors, k, v) is bit-for-bit the dense cache's,
  and errors match, for 2,000 sequences (profile ``ci``), plus the oracle directly.
- Quantization on: positions, cursors, errors and ``global_end`` still equal the dense
  cache's; k/v stay finite and shaped like the dense ones; and no position is ever packed
  twice within a stream (each encode of the segment store at the cache's codec, ``Packer.encode``, is recorded and
  checked for overlap).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from oracle import (
    assert_caches_agree,
    cursors,
    examples,
    run_sequence,
    scenarios,
)

from causalkv.caches import CausalCacheSpec, DenseCausalKVCache
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache

PARITY_SEQUENCES = examples(2000)


def packed_off(spec: CausalCacheSpec) -> QVGPackedCausalKVCache:
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
    """Records every packed run per stream and fails on a position packed twice (a hook on
    its segment store's one encode, `Packer.encode`)."""

    def __init__(self, spec, quant):
        super().__init__(spec, quant)
        self.packed_runs: list[tuple[int, int]] = []
        encode = self.store.packer.encode

        def recording(step, pieces, codebook):
            seg, book = encode(step, pieces, codebook)
            if not step.tier:  # at the cache's codec (a recency-tier pack is re-packed once)
                for a, b in self.packed_runs:
                    assert seg.end <= a or seg.start >= b, f"[{seg.start},{seg.end}) packed twice"
                self.packed_runs.append((seg.start, seg.end))
            return seg, book

        object.__setattr__(self.store.packer, "encode", recording)

    def reset_indices(self):
        super().reset_indices()
        self.packed_runs = []


def same_positions(a, b, where: str) -> None:
    """Quantized views: same positions and cursors, k/v finite and shaped like the dense ones."""
    assert torch.equal(a.positions, b.positions), f"{where}: positions"
    assert cursors(a) == cursors(b), f"{where}: cursors"
    for label in ("k", "v"):
        ta, tb = getattr(a, label), getattr(b, label)
        assert ta.shape == tb.shape and ta.dtype == tb.dtype, f"{where}: {label} shape/dtype"
        assert torch.isfinite(tb).all(), f"{where}: {label} not finite"


@settings(max_examples=examples(400))
@given(scenarios(max_ops=32))
def test_packed_quant_on_positions_equal_dense_and_never_repacks(scenario):
    spec, ops = scenario
    quant = QVGKVQuantArgs(codec="int2", centroids=4, block_size=4, keep_recent_chunks=0)
    # _RecordingPacked fails inside the run if any position is packed twice in a stream
    assert_caches_agree(
        DenseCausalKVCache, lambda s: _RecordingPacked(s, quant), spec, ops,
        compare_views=same_positions,
    )
