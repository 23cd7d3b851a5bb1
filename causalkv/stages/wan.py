"""`WanCausalDMDStage`: Self-Forcing / CausVid on a causal Wan 2.1 transformer.

The plain chunk loop of `CausalDenoisingStage`: 4 DMD steps (1000, 750, 500, 250 with
shift 5) plus the context pass per chunk, a sink of ``sink_frames`` (0 for Self-Forcing)
and a rolling window of ``window_frames`` (21: global attention over a 21-frame video).
A new prompt only swaps the cross-attention K/V; the self-attention cache is kept.
"""

from __future__ import annotations

from causalkv.stages.base import CausalDenoisingStage

__all__ = ["WanCausalDMDStage"]


class WanCausalDMDStage(CausalDenoisingStage):
    """Self-Forcing / CausVid: the base loop, QVG-capable."""

    has_qvg = True
