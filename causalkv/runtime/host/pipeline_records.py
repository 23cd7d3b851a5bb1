"""The host's records: a request (`GenerateOptions`), the plugins of one run (`PluginSet`),
a validated request (`Plan`) and the outcome of a chunk loop (`GenerationRun`).

Every step of `causalkv.runtime.host.generate` (plan, load, run, compare, write) reads and returns
these; none of them holds logic beyond what its fields derive.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from causalkv.config import ModelConfig, ServerArgs
from causalkv.plugin import (
    PluginLoadFailure,
    PluginSetAsideError,
    Registry,
    collect,
    get_plugin_manager,
)

if TYPE_CHECKING:
    import pluggy
    import torch

    from causalkv.runtime.host.resolve import Resolution
    from causalkv.runtime.model_io.components import Components
    from causalkv.runtime.model_io.model_config import RuntimeModelInfo
    from causalkv.stages.base import CausalDenoisingStage
    from causalkv.stages.records import ChunkStats
    from causalkv.stages.settings import StreamSettings

__all__ = ["DEFAULT_PROMPT", "GenerateOptions", "GenerationRun", "Plan", "PluginSet"]

DEFAULT_PROMPT = "A red fox trots through fresh snow in a pine forest at dawn, cinematic light."


@dataclass
class GenerateOptions:
    """One ``causalkv generate`` request.

    Attributes:
        model: preset name or model folder.
        prompts: one prompt per shot; the stage splits them into chunk prompts.
        frames: latent frames (None: the model's ``default_frames``).
        server_args: sink/window overrides, seed, dtype, device, ``--cache``, and the stage
            families' and caches' option records (``server_args.options``).
        guidance_scale: CFG scale (None: the model's default; used by LongLive 2.0).
        negative_prompt: negative CFG text (None: the model's default).
        stage: force a stage by registration name (None: resolution picks).
        compare_bf16: also run without the cache's settings (quantization off, same seed)
            and report latent PSNR.
        compare_dtype: the KV-cache dtype of that reference run (``--compare-dtype``;
            default bf16, whatever ``--dtype`` the run computes in).
        output: the video file (None: do not decode).
        quiet: no progress bar.
        metrics: write the metrics JSON here (atomically; None: do not write).
        save_latents: save the latents ``[B, C, F, h, w]`` to this ``.safetensors`` file.
        strict_plugins: any plugin fault is fatal: a plugin set aside while loading or
            collecting (`causalkv.plugin.PluginSetAsideError`, before anything loads) and a
            ``causalkv_chunk_done`` implementation that raises (`causalkv.plugin.PluginHookError`)
            instead of being reported once and skipped.
        force: replace an output file that holds something else than what its flag writes
            (`causalkv.runtime.files.file_checks.check_no_other_work`), atomically.
    """

    model: str = "tiny-wan"
    prompts: Sequence[str] = (DEFAULT_PROMPT,)
    frames: int | None = None
    server_args: ServerArgs = field(default_factory=ServerArgs)
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    stage: str | None = None
    compare_bf16: bool = False
    compare_dtype: str = "bfloat16"
    output: str | Path | None = None
    quiet: bool = False
    metrics: str | Path | None = None
    save_latents: str | Path | None = None
    strict_plugins: bool = False
    force: bool = False


@dataclass(frozen=True)
class PluginSet:
    """The plugins of one run, collected once: the manager (its run-time hooks:
    ``causalkv_configure_stage``, ``causalkv_chunk_done``) and the registry of its stages,
    caches and presets. A plan carries it; every step reads it there."""

    pm: pluggy.PluginManager
    registry: Registry

    @classmethod
    def collect(cls, pm: Any = None, *, reserved_flags: Iterable[str] = ()) -> PluginSet:
        """Collect ``pm``'s registrations (default: the process-wide manager's); a plugin that
        fails or clashes (with ``reserved_flags`` too: the host's own) is set aside."""
        pm = pm if pm is not None else get_plugin_manager()
        return cls(pm, collect(pm, reserved_flags=reserved_flags))

    @property
    def failures(self) -> tuple[PluginLoadFailure, ...]:
        """Every plugin set aside: while loading (``pm.load_failures``) and collecting."""
        return (*getattr(self.pm, "load_failures", ()), *self.registry.failures)  # a bare pluggy manager has none

    def refuse_failures(self) -> None:
        """``--strict-plugins``: `PluginSetAsideError` naming the first plugin set aside."""
        if self.failures:
            raise PluginSetAsideError(f"{self.failures[0]} (--strict-plugins makes this fatal)")


@dataclass
class Plan:
    """A validated request: model, effective server args, resolution, per-chunk prompts and
    their RoPE starts, and the plugins it was planned with."""

    info: RuntimeModelInfo
    server_args: ServerArgs
    resolution: Resolution
    num_frames: int
    prompts: list[str]
    chunk_prompts: list[str]
    settings: StreamSettings
    negative_prompt: str = ""
    plugins: PluginSet | None = None
    #: each chunk's RoPE start frame as the stage's chunk loop will place it
    #: (`CausalDenoisingStage.planned_rope_frame_starts`), planned with ``chunk_prompts``
    rope_frame_starts: list[float] = field(default_factory=list)
    #: what the run changes of what the request asked (one ``causalkv: warning:`` line each,
    #: printed before the load): e.g. a window longer than the video
    warnings: list[str] = field(default_factory=list)

    @property
    def model(self) -> ModelConfig:
        return self.info.config

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_prompts)

    def plugin_set(self, pm: Any = None) -> PluginSet:
        """The plugins it was planned with (a plan built by hand: collected from ``pm``)."""
        if self.plugins is not None and (pm is None or pm is self.plugins.pm):
            return self.plugins
        return PluginSet.collect(pm)


@dataclass
class GenerationRun:
    """The outcome of one chunk loop: latents ``[B, C, F, h, w]``, one `ChunkStats` per
    chunk, the stage."""

    latents: torch.Tensor
    chunk_stats: list[ChunkStats]
    stage: CausalDenoisingStage
    kv_resident_bytes_final: int
    components: Components | None = None
    load_seconds: float = 0.0

    @property
    def seconds_per_chunk(self) -> list[float]:
        return [float(s.seconds) for s in self.chunk_stats]

    @property
    def seconds_per_chunk_mean(self) -> float:
        return sum(self.seconds_per_chunk) / max(1, len(self.chunk_stats))

    @property
    def kv_resident_bytes_max(self) -> int:
        return max([*(int(s.kv_resident_bytes) for s in self.chunk_stats), self.kv_resident_bytes_final])
