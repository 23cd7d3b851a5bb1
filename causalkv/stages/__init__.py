"""Denoising stages: the base chunk loop and the per-model stages (each module is the one home of
its model family: stage class, registration, config defaults and tiny preset)."""

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
