"""Denoising stages: the base chunk loop and the per-model stages."""

from causalkv.stages.base import CausalDenoisingStage
from causalkv.stages.lingbot import LingBotWorldStage
from causalkv.stages.longlive import LongLiveStage
from causalkv.stages.longlive2 import LongLive2Stage
from causalkv.stages.wan import WanCausalDMDStage

__all__ = [
    "CausalDenoisingStage",
    "LingBotWorldStage",
    "LongLive2Stage",
    "LongLiveStage",
    "WanCausalDMDStage",
]
