"""`StagePlanning`: what a stage declares and checks before any weights load.

The base class of every stage (`causalkv.stages.base.CausalDenoisingStage`), holding its
class-level half: the capabilities the resolver reads (QVG, multi-shot, CFG, the cache
features a request needs), the family's option records, the sampler it drives (as data,
`SchedulerSpec`), the effective stream settings, and request planning (one prompt per chunk,
the planned RoPE starts) with its validation. A subclass overrides any of these classmethods;
nothing here needs weights, a device or the runtime, and nothing reads or writes a stage
instance (the run time is `CausalDenoisingStage`, the chunk loop `causalkv.stages.loop.ChunkLoop`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from causalkv.config import check_prompts
from causalkv.errors import ConfigError, alternatives, check_int, multiples_around
from causalkv.stages.scheduler import SchedulerSpec, flow_match
from causalkv.stages.settings import StreamSettings, even_split

if TYPE_CHECKING:
    from causalkv.config import ModelConfig, ServerArgs

__all__ = ["StagePlanning"]


class StagePlanning:
    """Load-time declarations and request planning of a stage (classmethods; see the module
    docstring). `CausalDenoisingStage` adds the run-time half."""

    # ---- load-time declarations -----------------------------------------------------------
    #: what a family declares (False here): QVG KV-cache quantization, pinned shot sinks,
    #: classifier-free guidance (a negative branch); the three classmethods below answer them
    has_qvg: ClassVar[bool] = False
    has_multi_shot: ClassVar[bool] = False
    has_guidance: ClassVar[bool] = False

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return cls.has_qvg

    @classmethod
    def supports_multi_shot(cls) -> bool:
        return cls.has_multi_shot

    @classmethod
    def supports_guidance(cls) -> bool:
        """Does this stage run classifier-free guidance (a negative branch)?"""
        return cls.has_guidance

    @classmethod
    def check_guidance(cls, asked: Mapping[str, object], *, guidance_scale: float, stage_name: str) -> None:
        """Refuse CFG settings that would do nothing (`ConfigError`, naming the stage and the
        setting). ``asked``: the setting (a flag, or a key of the model's config) -> its value,
        for each the request or the model sets; ``guidance_scale`` the effective scale.

        Here (no CFG) every one is refused; a CFG stage refuses a negative prompt while the
        guidance is off (scale <= 1)."""
        if not asked:
            return
        if not cls.supports_guidance():
            raise ConfigError(
                f"{' and '.join(asked)} set(s) classifier-free guidance, which stage "
                f"{stage_name!r} ({cls.__name__}) does not run; drop {'them' if len(asked) > 1 else 'it'} "
                "or pick a stage with CFG (LongLive 2.0)"
            )
        negative = [k for k in asked if "negative" in k]
        if negative and guidance_scale <= 1.0:
            raise ConfigError(
                f"{negative[0]} is used by the negative CFG branch, which is off at guidance scale "
                f"{guidance_scale:g} on stage {stage_name!r}; pass --guidance-scale > 1 or drop it"
            )

    @classmethod
    def required_cache_features(
        cls, server_args: ServerArgs, model: ModelConfig | None = None
    ) -> frozenset[str]:
        """Cache capabilities this stage needs under ``server_args`` (and ``model``): what the
        request asks for (`ServerArgs.requirement_reasons`: pinned sinks, head slices, a
        recent window, and every option record's own, e.g. ``quant:qvg`` for QVG bits)."""
        return frozenset(server_args.requirement_reasons(model))

    @classmethod
    def wants_multi_shot(cls, model: ModelConfig, server_args: ServerArgs, num_shots: int) -> bool:
        """Should a request of ``num_shots`` prompts pin shot sinks (``multi_shot``)? Several
        shots on a stage that supports it, with a non-empty sink."""
        if server_args.multi_shot or num_shots < 2 or not cls.supports_multi_shot():
            return False
        return cls.stream_settings(model, server_args).sink_frames > 0

    @classmethod
    def stream_settings(cls, model: ModelConfig, server_args: ServerArgs) -> StreamSettings:
        """The effective sink / window / cache / recent window, validated (`ConfigError`).

        ``server_args`` overrides (``sink_frames``, ``window_frames``,
        ``recent_window_frames``) win over the model config; an overridden window is also
        the cache size, otherwise the cache holds ``max(cache_frames, window)``.
        """
        sink = model.sink_frames if server_args.sink_frames is None else server_args.sink_frames
        global_sink = min(sink, model.global_sink_frames if model.global_sink_frames is not None else sink)
        window = model.window_frames if server_args.window_frames is None else server_args.window_frames
        overridden = server_args.window_frames is not None
        cache = window if overridden else max(model.cache_frames or 0, window)
        recent = server_args.recent_window_frames
        return StreamSettings(
            frames_per_chunk=model.frames_per_chunk,
            tokens_per_frame=model.tokens_per_frame,
            sink_frames=sink,
            global_sink_frames=global_sink,
            window_frames=window,
            cache_frames=cache,
            recent_window_frames=model.recent_window_frames if recent is None else recent,
            multi_shot=cls.supports_multi_shot() and server_args.multi_shot,
        )

    @classmethod
    def scheduler_spec(cls, model: ModelConfig) -> SchedulerSpec:
        """The sampler this stage drives, declared as data: diffusers' flow-matching Euler
        scheduler with the model's shift (the DMD loop reads its ``sigmas``/``timesteps``).
        Stages with another sampler (LongLive 2.0: UniPC) override this."""
        return flow_match(model.shift)

    @classmethod
    def check_request_fields(cls, server_args: ServerArgs, num_chunks: int) -> None:
        """Refuse values of the family's own request knobs that cannot serve ``num_chunks``
        chunks (`ConfigError`). Nothing here. (Another family's knobs are refused by the
        resolution, `causalkv.runtime.resolve`, the one refusal of foreign records.)"""

    @classmethod
    def plan_chunks(
        cls, prompts: Sequence[str], num_chunks: int, server_args: ServerArgs
    ) -> list[str]:
        """One prompt per chunk from the request's prompts (one per shot).

        Shots get ``num_chunks // len(prompts)`` chunks, earlier shots one more while chunks
        remain. Stages with a richer request model (LongLive 2.0 scene cuts) override this.
        Request fields the stage does not model are refused (`check_request_fields`).
        """
        prompts = check_prompts(prompts)
        cls.check_request_fields(server_args, num_chunks)
        if num_chunks < len(prompts):
            raise ConfigError(
                f"{len(prompts)} prompts need at least {len(prompts)} chunks, the request has "
                f"{num_chunks}; pass more --frames or fewer --prompt"
            )
        return [p for p, n in zip(prompts, even_split(num_chunks, len(prompts))) for _ in range(n)]

    @classmethod
    def check_request(
        cls,
        model: ModelConfig,
        server_args: ServerArgs,
        num_frames: int,
        chunk_prompts: Sequence[str] | None = None,
    ) -> StreamSettings:
        """Validate a request before any heavy work; return its `StreamSettings`.

        Raises `ConfigError` when ``num_frames`` is not a positive multiple of
        ``frames_per_chunk``, when a prompt is empty or there is not one per chunk, or when
        the stream settings are invalid.
        """
        settings = cls.stream_settings(model, server_args)
        fpc = settings.frames_per_chunk
        check_int("frames", num_frames, minimum=1, hint="fix --frames")
        if num_frames % fpc:
            choices = alternatives(multiples_around(num_frames, fpc))
            raise ConfigError(
                f"frames={num_frames} is not divisible by frames per chunk={fpc} of "
                f"{model.name}; pass --frames {choices}"
            )
        if chunk_prompts is not None and len(check_prompts(chunk_prompts)) != num_frames // fpc:
            raise ConfigError(
                f"got {len(chunk_prompts)} chunk prompts for {num_frames // fpc} chunks; "
                "give one prompt per chunk"
            )
        return settings

    @classmethod
    def planned_rope_frame_starts(
        cls,
        model: ModelConfig,
        server_args: ServerArgs,
        settings: StreamSettings,
        chunk_prompts: Sequence[str],
    ) -> list[float]:
        """The RoPE start frame of each chunk, known before any weights load (the host checks
        them against the model's RoPE limit). Must agree with `rope_frame_offset` in the
        chunk loop; here: the chunk's own first frame."""
        return [float(i * settings.frames_per_chunk) for i in range(len(chunk_prompts))]
