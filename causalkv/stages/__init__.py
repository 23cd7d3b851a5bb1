"""Denoising stages: the base chunk loop and the per-model stages (each stage module holds its
model family's stage class; `causalkv.stages.families` holds the families' registrations,
presets and option records, torch-free).

The stage classes are imported on first use (``from causalkv.stages import LongLive2Stage``),
so importing `causalkv.stages.families` (the command line's ``--help``) imports no torch.
"""

from __future__ import annotations

from causalkv.lazy import lazy_names

_HOMES = {
    "CausalDenoisingStage": "causalkv.stages.base",
    "LingBotWorldStage": "causalkv.stages.lingbot",
    "LongLive2Stage": "causalkv.stages.longlive2",
    "LongLiveStage": "causalkv.stages.longlive",
    "WanCausalDMDStage": "causalkv.stages.wan",
}


__all__ = sorted(_HOMES)
__getattr__ = lazy_names(__name__, _HOMES)
