"""`LongLive2Stage`: LongLive 2.0 multi-shot generation with a pinned shot sink and CFG.

The request model is the seed runtime's (sglang 0.5.23 ``multimodal_gen``, LongLive 2.0):

- Shots: the request's prompts are the shot prompts; `expand_shots` turns them into one
  prompt per chunk, a scene-cut mask and a shot index per chunk (`ShotPlan`), from the
  family's request record `ShotRequest` (its flags ``--shot-durations``, ``--chunks-per-shot``,
  ``--scene-cut-prefix``, ``--no-multi-shot-sink``, ``--multi-shot-rope-offset`` are declared
  there and reach ``causalkv generate`` through the registration): explicit durations in chunks, else
  ``chunks_per_shot`` for every shot, else an even split with the first shots one chunk
  longer; durations are clamped to the chunk count and the chunks left over go to the last
  shot. A cut is the first chunk of every shot after the first; its prompt is
  ``scene_cut_prefix + shot prompt`` (no prefix when it is empty).
- Sinks: the caches keep a global sink (``global_sink_frames`` at the stream start) and a
  shot sink of ``sink_frames``. With multi-shot sinks on (``multi_shot_sink``, the default)
  and a non-zero sink, after a cut chunk's context pass every cache (both CFG branches)
  pins the chunk (``pin_current_chunk``), so the shot keeps attending to its own opening
  while the previous shot's sink rolls out. The host then plans the request as
  ``ServerArgs.multi_shot`` (a cache with the ``pinned_sink`` capability).
- RoPE: chunk ``i`` of shot ``k`` starts at RoPE frame ``i * frames_per_chunk + k *
  offset``, ``offset`` = ``multi_shot_rope_offset`` (a float; fractional offsets are
  continuous RoPE positions), or the model's ``rope_offset_frames_per_shot`` when the
  request gives none (a key of the family's ``causalkv.json`` record `LongLive2Config`).
- Sampler: the seed runtime's ``FlowUniPCMultistepScheduler(num_train_timesteps=1000,
  shift=1, use_dynamic_shifting=False)``, reset per chunk with ``set_timesteps(steps,
  shift=flow_shift)``. Its diffusers equivalent (`scheduler_spec`, `unipc_sigmas`)::

      UniPCMultistepScheduler(num_train_timesteps=1000, solver_order=2,
          prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=model.shift,
          predict_x0=True, solver_type="bh2", lower_order_final=True,
          final_sigmas_type="zero")
      .set_timesteps(sigmas=linspace(sigma_max, 0, steps + 1)[:-1])

  (declared as data, `scheduler_spec`), where ``sigma_max = float32(1 - 1/1000)`` is the top of the shift-1 training schedule
  (diffusers' own flow sigmas would start at 1 instead). The shift applied to the
  inference sigmas is the model's ``shift`` (the seed runtime passes the pipeline's
  ``flow_shift``, 5 for LongLive 2.0, to ``set_timesteps``); the step count is the number of
  the model's ``timesteps`` (4, the seed runtime's ``num_inference_steps``). Timesteps are
  ``int64(sigma * 1000)``; the last sigma is 0, so the last step lands on the clean latents.
- Classifier-free guidance: with ``guidance_scale > 1`` a negative branch runs on its own
  caches (same spec, same factory) with the negative prompt;
  ``pred = neg + guidance_scale * (pos - neg)``, then one scheduler step. Both branches get
  the context pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from causalkv.config import ModelConfig, ServerArgs, check_prompts
from causalkv.errors import ConfigError, check_int
from causalkv.stages.base import CausalDenoisingStage
from causalkv.stages.families import SCENE_CUT_PREFIX, LongLive2Config, ShotRequest, check_durations
from causalkv.stages.scheduler import SchedulerSpec
from causalkv.stages.settings import even_split

__all__ = [
    "LongLive2Stage",
    "ShotLayout",
    "ShotPlan",
    "expand_shots",
    "unipc_sigmas",
]


#: the seed runtime's UniPC training schedule: 1000 timesteps, shift 1; its top sigma
NUM_TRAIN_TIMESTEPS = 1000
UNIPC_SIGMA_MAX = float(np.float32(1.0 - 1.0 / NUM_TRAIN_TIMESTEPS))


@dataclass(frozen=True)
class ShotLayout:
    """Per chunk: the prompt, whether it opens a shot after the first (a cut), its shot index."""

    chunk_prompts: tuple[str, ...]
    scene_cuts: tuple[bool, ...]
    shot_indices: tuple[int, ...]


class ShotPlan(list):  # type: ignore[type-arg]
    """The per-chunk prompts (a ``list[str]``, so it goes wherever chunk prompts go) carrying
    the `ShotLayout` they were expanded with (``layout``)."""

    layout: ShotLayout

    def __init__(self, layout: ShotLayout) -> None:
        super().__init__(layout.chunk_prompts)
        self.layout = layout


def expand_shots(
    shot_prompts: Sequence[str],
    num_chunks: int,
    *,
    durations: Sequence[int] | None = None,
    chunks_per_shot: int = 0,
    scene_cut_prefix: str = SCENE_CUT_PREFIX,
) -> ShotLayout:
    """Expand shots into chunks with the seed runtime's rules.

    Durations (in chunks): ``durations`` when given (one per shot), else ``chunks_per_shot``
    for every shot when > 0, else an even split: ``num_chunks // shots`` each and the first
    ``num_chunks % shots`` shots one more. Shots then take ``min(duration, chunks left)``
    in order; a shot that finds no chunk left is dropped; chunks still left go to the last
    shot that got any. Chunk ``c`` of shot ``k`` is a cut when ``k > 0`` and ``c == 0``; its
    prompt is ``scene_cut_prefix + prompt`` (just ``prompt`` for an empty prefix).

    Raises `ConfigError` for an empty shot list or prompt, ``num_chunks < 1``, durations
    whose count differs from the shots' or that are not positive ints, and a negative
    ``chunks_per_shot``.
    """
    prompts = check_prompts(shot_prompts)
    check_int("chunks", num_chunks, minimum=1, hint="pass more --frames")
    check_int("--chunks-per-shot", chunks_per_shot, minimum=0, hint="or 0 for an even split")
    if durations is not None:
        wanted = list(check_durations(durations))
        if len(wanted) != len(prompts):
            raise ConfigError(
                f"shot durations must match the shot prompts: {len(wanted)} durations "
                f"{wanted} for {len(prompts)} shots; give one --shot-durations entry per --shot-prompt"
            )
    elif chunks_per_shot > 0:
        wanted = [chunks_per_shot] * len(prompts)
    else:
        wanted = even_split(num_chunks, len(prompts))
    shots: list[int] = []  # the shot of each chunk: shots in order, each clamped to what is left
    for k, d in enumerate(wanted):
        shots += [k] * min(int(d), num_chunks - len(shots))
    shots += shots[-1:] * (num_chunks - len(shots))  # chunks left over: the last shot's
    cuts = tuple(i > 0 and k != shots[i - 1] for i, k in enumerate(shots))
    chunk_prompts = tuple(scene_cut_prefix + prompts[k] if cut else prompts[k] for k, cut in zip(shots, cuts))
    return ShotLayout(chunk_prompts, cuts, tuple(shots))


def layout_of(chunk_prompts: Sequence[str], server_args: ServerArgs) -> ShotLayout:
    """The `ShotLayout` of ``chunk_prompts``: its own when it is a `ShotPlan`; for a plain
    list, a chunk after the first is a cut when it starts with the request's non-empty
    scene-cut prefix (with an empty prefix: when its prompt differs from the previous one)."""
    if isinstance(chunk_prompts, ShotPlan):
        return chunk_prompts.layout
    prompts = list(chunk_prompts)
    prefix = server_args.option(ShotRequest).scene_cut_prefix
    cuts = tuple(
        i > 0 and (p.startswith(prefix) if prefix else p != prompts[i - 1]) for i, p in enumerate(prompts)
    )
    return ShotLayout(tuple(prompts), cuts, tuple(accumulate(int(c) for c in cuts)))


def unipc_sigmas(num_steps: int) -> np.ndarray:
    """The seed runtime's unshifted inference sigmas: ``linspace(sigma_max, 0, steps + 1)[:-1]``
    (float64), ``sigma_max = float32(1 - 1/1000)``; the scheduler applies the shift."""
    check_int("denoising steps", num_steps, minimum=1, hint="give the model at least one timestep")
    return np.linspace(UNIPC_SIGMA_MAX, 0.0, num_steps + 1)[:-1].copy()


class LongLive2Stage(CausalDenoisingStage):
    """LongLive 2.0: shots expanded to chunks, global sink + pinned shot sink, per-shot
    RoPE offset, UniPC sampling, CFG."""

    options: ShotRequest  # the request's record (the registration declares it)

    #: the layout of the request being generated (set by `begin_request`)
    layout: ShotLayout | None = None

    has_qvg = has_multi_shot = has_guidance = True

    @classmethod
    def scheduler_spec(cls, model: ModelConfig) -> SchedulerSpec:
        """diffusers ``UniPCMultistepScheduler`` set up as the seed runtime's flow UniPC
        (see the module docstring)."""
        return SchedulerSpec("diffusers:UniPCMultistepScheduler", {
            "num_train_timesteps": NUM_TRAIN_TIMESTEPS,
            "solver_order": 2,
            "prediction_type": "flow_prediction",
            "use_flow_sigmas": True,
            "flow_shift": float(model.shift),
            "predict_x0": True,
            "solver_type": "bh2",
            "lower_order_final": True,
            "final_sigmas_type": "zero",
        })

    @classmethod
    def wants_multi_shot(cls, model: ModelConfig, server_args: ServerArgs, num_shots: int) -> bool:
        """The base rule, unless the request turned multi-shot sinks off (``--no-multi-shot-sink``)."""
        return super().wants_multi_shot(model, server_args, num_shots) and (
            server_args.option(ShotRequest).multi_shot_sink
        )

    @classmethod
    def plan_chunks(
        cls, prompts: Sequence[str], num_chunks: int, server_args: ServerArgs
    ) -> list[str]:
        """The request's prompts are the shots: their `expand_shots` expansion under
        the request's `ShotRequest`, as a `ShotPlan` (a list of chunk prompts with its layout)."""
        cls.check_request_fields(server_args, num_chunks)
        shots = server_args.option(ShotRequest)
        if len(check_prompts(prompts)) == 1 and shots.changed():  # a shot field was given
            raise ConfigError(
                "shot flags (--shot-durations, --chunks-per-shot, --scene-cut-prefix, "
                "--no-multi-shot-sink, --multi-shot-rope-offset) shape a multi-shot request, and "
                "this one has a single shot; drop them or pass one --prompt per shot"
            )
        if shots.durations is not None and shots.chunks_per_shot > 0:
            raise ConfigError(
                f"--chunks-per-shot {shots.chunks_per_shot} does nothing beside --shot-durations (the "
                "durations win); pass one of them"
            )
        layout = expand_shots(
            prompts,
            num_chunks,
            durations=shots.durations,
            chunks_per_shot=shots.chunks_per_shot,
            scene_cut_prefix=shots.scene_cut_prefix,
        )
        got = len(set(layout.shot_indices))
        if got < len(prompts):  # the seed runtime drops a shot that finds no chunk: refused here
            wanted = (list(shots.durations) if shots.durations is not None
                      else [shots.chunks_per_shot] * len(prompts) if shots.chunks_per_shot else None)
            need = sum(wanted[:-1]) + 1 if wanted is not None else len(prompts)
            shorter = ("shorter --shot-durations, " if shots.durations is not None
                       else "fewer --chunks-per-shot, " if shots.chunks_per_shot else "")
            raise ConfigError(
                f"{len(prompts)} shots on {num_chunks} chunks: shot {got + 1} ({prompts[got]!r}) "
                + (f"and the {len(prompts) - got - 1} after it " if len(prompts) - got > 1 else "")
                + f"would get no chunk (the shots before it take all {num_chunks}); pass --frames "
                f"for at least {need} chunks, {shorter}or fewer shots"
            )
        return ShotPlan(layout)

    # ---- schedule --------------------------------------------------------------------------
    def sampler_sigmas(self, model: ModelConfig) -> Any:
        """UniPC: ``len(model.timesteps)`` steps over `unipc_sigmas` (the scheduler shifts them
        by ``model.shift``)."""
        return unipc_sigmas(len(model.timesteps))

    def sampler_step(
        self, j: int, x: torch.Tensor, pred: torch.Tensor, generator: torch.Generator
    ) -> torch.Tensor:
        """One step of the UniPC multistep sampler, its history reset at each chunk's first
        step (as the seed runtime does); ``generator`` is unused (the sampler draws no noise)."""
        sched = self.scheduler
        if j == 0:
            sched.set_timesteps(sigmas=self.sampler_sigmas(self.model))
            sched.set_begin_index(0)  # no timestep lookup (a device sync) on the first step
        return sched.step(pred, sched.timesteps[j], x, return_dict=False)[0]

    # ---- shots -------------------------------------------------------------------------------
    @staticmethod
    def rope_offset_per_shot(model: ModelConfig, shots: ShotRequest) -> float:
        """RoPE frames added per shot index: the request's (``shots``), else the model's."""
        off = shots.multi_shot_rope_offset
        return float(model.option(LongLive2Config).rope_offset_frames_per_shot if off is None else off)

    def pins(self, chunk_index: int | None) -> bool:
        """Chunk ``chunk_index`` is pinned as its shot's sink after its context pass: a scene
        cut of a multi-shot request with multi-shot sinks and a sink."""
        return bool(
            chunk_index is not None and self.server_args.multi_shot and self.options.multi_shot_sink
            and self.settings.sink_frames > 0 and self.layout is not None
            and self.layout.scene_cuts[chunk_index]
        )

    def report(self) -> dict[str, Any]:
        layout = self.layout
        return {
            "pinned_chunks": list(self.pinned_chunks),
            "scene_cut_chunks": [i for i, c in enumerate(layout.scene_cuts) if c] if layout else [],
            "shot_per_chunk": list(layout.shot_indices) if layout else [],
            "rope_frame_start_per_chunk": list(self.rope_frame_starts),
            "sampler": "unipc",
            "sampler_timesteps": list(self.timesteps),
            "sampler_sigmas": list(self.sigmas),
        }

    def _reset_stream(self) -> None:
        super()._reset_stream()
        #: chunk indices pinned as shot sinks
        self.pinned_chunks: list[int] = []
        #: RoPE start frame of each chunk generated so far
        self.rope_frame_starts: list[float] = []

    def begin_request(self, chunk_prompts: Sequence[str]) -> None:
        """The request's layout: of ``chunk_prompts`` (a `ShotPlan`, or a plain list: see `layout_of`)."""
        self.layout = layout_of(chunk_prompts, self.server_args)

    @classmethod
    def planned_rope_frame_starts(
        cls,
        model: ModelConfig,
        server_args: ServerArgs,
        settings: Any,
        chunk_prompts: Sequence[str],
    ) -> list[float]:
        """Chunk start plus shot index x the per-shot RoPE offset (as `rope_frame_offset`)."""
        per_shot = cls.rope_offset_per_shot(model, server_args.option(ShotRequest))
        shots = layout_of(chunk_prompts, server_args).shot_indices
        fpc = settings.frames_per_chunk
        return [i * fpc + shot * per_shot for i, shot in enumerate(shots)]

    def rope_frame_offset(self, chunk_index: int, prompt: str) -> float:
        shot = self.layout.shot_indices[chunk_index] if self.layout is not None else 0
        offset = shot * self.rope_offset_per_shot(self.model, self.options)
        return int(offset) if float(offset).is_integer() else offset

    def pins_after_context(self) -> bool:
        """True when the chunk being generated is a scene cut whose chunk is pinned."""
        return self.pins(self._chunk_index)

    _chunk_index: int | None = None

    def begin_chunk(self, chunk_index: int, prompt: str, latents: torch.Tensor) -> None:
        self._chunk_index = chunk_index
        f0 = chunk_index * self.settings.frames_per_chunk
        self.rope_frame_starts.append(f0 + self.rope_frame_offset(chunk_index, prompt))

    def end_chunk(self, chunk_index: int, prompt: str) -> None:
        if not self.pins(chunk_index):
            return
        n = self.settings.tokens_per_chunk
        for cs in self.cache_sets():
            for cache in cs.kv:
                cache.pin_current_chunk(n)
        self.pinned_chunks.append(chunk_index)
