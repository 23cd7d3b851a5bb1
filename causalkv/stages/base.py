"""`CausalDenoisingStage`: the chunk-by-chunk denoising loop and its load-time declarations.

The loop (docs/design.md, "Flow"): for each chunk of ``frames_per_chunk`` latent frames and
each denoising timestep, run the transformer on the chunk at its global token start (the
first call advances every layer's cache, later calls rewrite the chunk in place), predict
``x0`` from the flow prediction, and re-noise ``x0`` to the next timestep with the seeded
generator. After the last step a context pass at ``context_noise`` writes the chunk's clean
K/V. Cross-attention K/V are computed once per prompt and cached per layer.

The stage knows nothing about diffusers: it drives a `ChunkDenoiser` (the runtime's causal
Wan transformer, or any object with the same call) and a diffusers-style flow-matching
scheduler (``set_timesteps(sigmas=...)``, ``sigmas``, ``timesteps``). Caches come from a
cache factory (``build(spec, quant)``), chosen by the plugin resolver.

Latent layout throughout: ``[B, C, F, h, w]`` (batch, latent channels, latent frames, latent
height, latent width), float32 outside the transformer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from causalkv.caches.cross import CrossAttentionKVCache
from causalkv.caches.spec import (
    HEAD_SLICE,
    PINNED_SINK,
    QUANT_QVG,
    RECENT_WINDOW,
    CausalKVCache,
    KVCacheSpec,
)
from causalkv.config import check_prompts
from causalkv.errors import ConfigError, NonFiniteLatentsError, UsageError, check_int

if TYPE_CHECKING:
    from causalkv.config import ModelConfig, ServerArgs

__all__ = [
    "CacheSet",
    "CausalDenoisingStage",
    "ChunkDenoiser",
    "ForwardRecord",
    "GenerationResult",
    "StreamSettings",
    "even_split",
]


class ChunkDenoiser(Protocol):
    """A transformer run causally over per-layer caches (the runtime's `CausalWanTransformer`).

    Attributes: ``num_layers``, ``num_heads``, ``head_dim``, ``dtype``, ``device``; a
    head-sharded denoiser (one rank of a sequence-parallel job) also has ``head_offset``, the
    global index of its first head (read when the caches are built; 0 when absent).
    """

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def __call__(
        self,
        latents: torch.Tensor,
        timestep: float,
        prompt_embeds: torch.Tensor,
        *,
        kv_caches: Sequence[CausalKVCache],
        cross_caches: Sequence[CrossAttentionKVCache],
        token_start: int,
        rope_frame_start: float,
        recent_window_tokens: int | None = None,
    ) -> torch.Tensor:
        """Flow prediction ``[B, C, F, h, w]`` (float32) for ``latents`` ``[B, C, F, h, w]``.

        Every self-attention layer writes its K/V for tokens ``[token_start, token_start +
        F * tokens_per_frame)`` into ``kv_caches[layer]`` and attends over the cache's view;
        RoPE uses frames ``[rope_frame_start, rope_frame_start + F)``.
        """
        ...


class CacheFactoryLike(Protocol):
    name: str

    def build(self, spec: KVCacheSpec, quant: Any = None) -> CausalKVCache: ...


@dataclass(frozen=True)
class StreamSettings:
    """The effective streaming policy of one request, in latent frames (model + overrides).

    Validated on construction (`ConfigError`, a ValueError naming the value and the flag).

    Attributes:
        frames_per_chunk, tokens_per_frame: chunk geometry.
        sink_frames: the sink (LongLive 2.0: the pinned shot sink's size).
        global_sink_frames: the stream-start sink kept while a shot sink is pinned.
        window_frames: frames attention sees at most (sink and current chunk included).
        cache_frames: frames each cache retains.
        recent_window_frames: LingBot-World recent-window sampling, or None.
        multi_shot: shot sinks are pinned: the window must hold both sinks plus a chunk.
    """

    frames_per_chunk: int
    tokens_per_frame: int
    sink_frames: int
    global_sink_frames: int
    window_frames: int
    cache_frames: int
    recent_window_frames: int | None
    multi_shot: bool = False

    def __post_init__(self) -> None:
        fpc = check_int("frames_per_chunk", self.frames_per_chunk, minimum=1,
                        hint="fix frames_per_chunk in causalkv.json")
        check_int("tokens_per_frame", self.tokens_per_frame, minimum=1,
                  hint="check the model's resolution and patch size")
        sink = check_int("sink frames", self.sink_frames, hint="fix --sink-frames")
        check_int("global sink frames", self.global_sink_frames, hint="fix global_sink_frames")
        window = check_int("window frames", self.window_frames, minimum=1, hint="fix --window-frames")
        if self.recent_window_frames is not None:
            check_int("recent window frames", self.recent_window_frames,
                      hint="fix --recent-window-frames")
        if self.global_sink_frames > sink:
            raise ConfigError(
                f"global sink of {self.global_sink_frames} frames exceeds the sink of {sink} "
                f"frames; lower global_sink_frames"
            )
        if window < fpc:
            raise ConfigError(
                f"window of {window} frames is smaller than a chunk of {fpc} frames; "
                f"pass --window-frames >= {fpc}"
            )
        max_sink = self.global_sink_frames + sink if self.multi_shot else sink
        if window < max_sink + fpc:
            what = (
                f"the global sink ({self.global_sink_frames}) plus a pinned shot sink ({sink})"
                if self.multi_shot
                else f"the sink ({sink})"
            )
            raise ConfigError(
                f"window of {window} frames cannot hold {what} plus a chunk of {fpc} frames; "
                f"pass --window-frames >= {max_sink + fpc} or a smaller --sink-frames"
            )
        if check_int("cache frames", self.cache_frames, minimum=1) < window:
            raise ConfigError(f"cache of {self.cache_frames} frames is smaller than the window of {window}")

    @property
    def tokens_per_chunk(self) -> int:
        return self.frames_per_chunk * self.tokens_per_frame

    @property
    def recent_window_tokens(self) -> int | None:
        if self.recent_window_frames is None:
            return None
        return self.recent_window_frames * self.tokens_per_frame

    def kv_spec(
        self,
        *,
        batch_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
        head_offset: int = 0,
    ) -> KVCacheSpec:
        """One layer's `KVCacheSpec` (all counts in tokens: frames x ``tokens_per_frame``);
        ``num_heads`` heads starting at global head ``head_offset`` (a head-sharded rank)."""
        tpf = self.tokens_per_frame
        return KVCacheSpec(
            batch_size=batch_size,
            num_heads=num_heads,
            head_dim=head_dim,
            cache_size=self.cache_frames * tpf,
            sink_tokens=self.sink_frames * tpf,
            global_sink_tokens=self.global_sink_frames * tpf,
            attention_window_size=self.window_frames * tpf,
            dtype=dtype,
            device=device,
            head_offset=head_offset,
        )


@dataclass
class CacheSet:
    """One branch's caches: a causal KV cache and a cross-attention cache per layer.

    ``prompt`` is the text whose cross-attention K/V the cross caches hold (None: empty).
    """

    kv: list[CausalKVCache]
    cross: list[CrossAttentionKVCache]
    prompt: str | None = None

    def reset(self) -> None:
        for cache in self.kv:
            cache.reset_indices()
        self.reset_cross()

    def reset_cross(self) -> None:
        for cache in self.cross:
            cache.reset()
        self.prompt = None

    def kv_resident_nbytes(self) -> int:
        return sum(cache.resident_nbytes() for cache in self.kv)


@dataclass(frozen=True)
class ForwardRecord:
    """One transformer call of the loop (for tracing and the oracle tests).

    ``latents``/``prediction``: ``[B, C, F, h, w]`` float32; ``step`` is the denoising step
    index, or ``-1`` for the context pass; ``token_start``/``rope_frame_start`` as passed.
    """

    chunk_index: int
    step: int
    timestep: float
    latents: torch.Tensor
    prediction: torch.Tensor
    token_start: int
    rope_frame_start: float
    branch: str = "positive"


@dataclass
class GenerationResult:
    """Clean latents ``[B, C, F, h, w]`` (float32) and one stats dict per chunk."""

    latents: torch.Tensor
    chunk_stats: list[dict[str, Any]] = field(default_factory=list)


def even_split(num_chunks: int, num_shots: int) -> list[int]:
    """Chunks per shot: ``num_chunks // num_shots`` each, the first shots one more while
    chunks remain. `ConfigError` when there are fewer chunks than shots."""
    if num_chunks < num_shots:
        raise ConfigError(
            f"{num_shots} prompts need at least {num_shots} chunks, the request has "
            f"{num_chunks}; pass more --frames or fewer --prompt"
        )
    base, extra = divmod(num_chunks, num_shots)
    return [base + (k < extra) for k in range(num_shots)]


class CausalDenoisingStage:
    """Base stage: runs a causal transformer chunk by chunk over per-layer KV caches.

    A stage is the home of its model family's behaviour; its `StageRegistration` (in the same
    module) names the models it serves, their config defaults and tiny presets.

    Load-time declarations (read by the resolver before any weights load):

    - `_supports_qvg_kv_cache_quantization()`: may this stage run on a QVG-packed cache?
      False here; a stage opts in by overriding it (the reference runtime's name).
    - `supports_multi_shot()`: may a request pin shot sinks (LongLive 2.0 scene cuts)?
    - `required_cache_features(server_args, model)`: the cache capabilities it needs, the
      one place a stage declares them.

    Request planning (before weights load): `plan_chunks` turns the request's prompts into
    one prompt per chunk. Run time: build with the model config, the server args, the
    transformer, the scheduler, the cache factory and a prompt encoder; the host may apply
    `causalkv_configure_stage` overrides (`apply_overrides`) before the caches are allocated
    on first use; then call `generate` once per request (the caches are reset each time).
    `report()` adds the stage's own entries to the run report.
    """

    # ---- load-time declarations -----------------------------------------------------------
    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return False

    @classmethod
    def supports_multi_shot(cls) -> bool:
        return False

    @classmethod
    def supports_guidance(cls) -> bool:
        """Does this stage run classifier-free guidance (a negative branch)? False here."""
        return False

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
        """Cache capabilities this stage needs under ``server_args`` (and ``model``)."""
        recent = server_args.recent_window_frames is not None or (
            model is not None and model.recent_window_frames is not None
        )
        wanted = {
            QUANT_QVG: server_args.kv_cache_quant_config.enabled,
            PINNED_SINK: server_args.multi_shot,
            HEAD_SLICE: server_args.heads_sharded > 1,
            RECENT_WINDOW: recent,
        }
        return frozenset(f for f, needed in wanted.items() if needed)

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
        cache = window
        if server_args.window_frames is None and model.cache_frames is not None:
            cache = max(model.cache_frames, window)
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
    def make_scheduler(cls, model: ModelConfig) -> Any:
        """The sampler this stage drives: diffusers' flow-matching Euler scheduler with the
        model's shift (the DMD loop reads its ``sigmas``/``timesteps``). Stages with another
        sampler (LongLive 2.0: UniPC) override this; the host builds it per stage."""
        from causalkv.runtime.loading import make_scheduler

        return make_scheduler(model.shift)

    @classmethod
    def check_request_fields(cls, server_args: ServerArgs, num_chunks: int) -> None:
        """Refuse request fields this stage does not model (`ConfigError`): shot layout
        flags (LongLive 2.0) and a motion signal (LingBot-World) here."""
        if not server_args.shots.is_default:
            raise ConfigError(
                f"shot flags (--shot-durations, --chunks-per-shot, --scene-cut-prefix, "
                f"--no-multi-shot-sink, --multi-shot-rope-offset) apply to multi-shot stages, "
                f"not to {cls.__name__}; drop them or pick a LongLive 2.0 model"
            )
        if server_args.motion is not None:
            raise ConfigError(
                f"--motion applies to LingBot-World's interactive window, not to {cls.__name__}; "
                "drop it or pick a LingBot-World model"
            )

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
            lo = num_frames - num_frames % fpc
            choices = f"{lo} or {lo + fpc}" if lo > 0 else f"{fpc}"
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

    # ---- construction ------------------------------------------------------------------------
    def __init__(
        self,
        model: ModelConfig,
        server_args: ServerArgs,
        *,
        denoiser: ChunkDenoiser,
        scheduler: Any,
        cache_factory: CacheFactoryLike,
        encode_prompt: Callable[[str], torch.Tensor],
        batch_size: int = 1,
        negative_prompt: str = "",
        name: str | None = None,
    ) -> None:
        """Build the stage; its caches are allocated on first use (`cache_sets`).

        Args:
            model: the model config (geometry, chunking, sink/window, schedule).
            server_args: quant config, overrides, multi-shot, seed, guidance.
            denoiser: the causal transformer (see `ChunkDenoiser`).
            scheduler: a diffusers flow-matching scheduler (``FlowMatchEulerDiscreteScheduler``
                with ``shift = model.shift``).
            cache_factory: builds one layer's cache: ``build(spec, quant)``.
            encode_prompt: text -> prompt embeddings ``[B, L, text_dim]``.
            batch_size: B of the latents and caches.
            negative_prompt: text of the negative branch of stages that run CFG.
            name: the stage's registration name (default: the class name).
        """
        self.name = name or type(self).__name__
        self.server_args = server_args
        self.denoiser = denoiser
        self.scheduler = scheduler
        self.cache_factory = cache_factory
        self.encode_prompt = encode_prompt
        self.batch_size = batch_size
        self.negative_prompt = negative_prompt
        self.quant = server_args.kv_cache_quant_config
        self._cache_sets: list[CacheSet] | None = None
        self.apply_model(model)
        self._reset_stream()

    def apply_model(self, model: ModelConfig) -> None:
        """(Re)derive everything that depends on the model config. Only before caches exist.

        Raises RuntimeError once the caches are allocated, and `ConfigError` (stage left as
        it was) when the config gives invalid stream settings.
        """
        if self._cache_sets is not None:
            raise UsageError(
                f"stage {self.name!r}: its KV caches are already allocated; apply model "
                "overrides before the first chunk (causalkv_configure_stage does)"
            )
        settings = self.stream_settings(model, self.server_args)
        self.model, self.settings = model, settings
        self.context_noise = float(model.context_noise)
        self.timesteps, self.sigmas = self.schedule(model)

    def schedule(self, model: ModelConfig) -> tuple[list[float], list[float]]:
        """``(timesteps, sigmas)`` of one chunk's denoising (``len(sigmas)`` may be one more).

        The DMD schedule: the model's timesteps as sigmas ``t / 1000``, shifted by the
        scheduler.
        """
        self.scheduler.set_timesteps(sigmas=[float(t) / 1000.0 for t in model.timesteps])
        return [float(t) for t in self.scheduler.timesteps], [float(s) for s in self.scheduler.sigmas]

    def apply_overrides(self, overrides: Mapping[str, Any]) -> None:
        """Apply `ModelConfig` field overrides (``causalkv_configure_stage``) to this stage."""
        if overrides:
            self.apply_model(replace(self.model, **overrides))

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV caches' dtype: ``server_args.kv_cache_dtype``, else the denoiser's."""
        name = self.server_args.kv_cache_dtype
        return self.denoiser.dtype if name is None else getattr(torch, name)

    def _new_cache_set(self) -> CacheSet:
        spec = self.settings.kv_spec(
            batch_size=self.batch_size,
            num_heads=self.denoiser.num_heads,
            head_dim=self.denoiser.head_dim,
            dtype=self.kv_dtype,
            device=self.denoiser.device,
            head_offset=getattr(self.denoiser, "head_offset", 0),
        )
        kv = [self.cache_factory.build(spec, self.quant) for _ in range(self.denoiser.num_layers)]
        cross = [CrossAttentionKVCache() for _ in range(self.denoiser.num_layers)]
        return CacheSet(kv=kv, cross=cross)

    def num_branches(self) -> int:
        """Cache sets this stage runs (CFG stages: 2, the positive branch first)."""
        return 1

    def cache_sets(self) -> list[CacheSet]:
        """Every cache set this stage owns (the positive branch first); allocated on first use."""
        if self._cache_sets is None:
            self._cache_sets = [self._new_cache_set() for _ in range(self.num_branches())]
        return self._cache_sets

    @property
    def caches(self) -> CacheSet:
        """The positive branch's caches."""
        return self.cache_sets()[0]

    def report(self) -> dict[str, Any]:
        """What this stage adds to the run report (LongLive 2.0: ``pinned_chunks``, ...)."""
        return {}

    def _reset_stream(self) -> None:
        #: next token start in the caches' positions (== every cache's global_end)
        self._token_end = 0
        #: (frame, rope frame) of each latent frame the caches hold, in cache-position order
        self._cache_frames: list[tuple[int, int]] = []

    def reset(self) -> None:
        """Forget the stream (new request): every self- and cross-attention cache is emptied."""
        if self._cache_sets is not None:
            for cs in self._cache_sets:
                cs.reset()
        self._reset_stream()

    def kv_resident_nbytes(self) -> int:
        """Bytes all self-attention caches of all branches hold now."""
        return sum(cs.kv_resident_nbytes() for cs in self.cache_sets())

    @property
    def cache_name(self) -> str:
        return getattr(self.cache_factory, "name", type(self.cache_factory).__name__)

    # ---- per-chunk policy (subclasses override) ------------------------------------------
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

    def rope_frame_offset(self, chunk_index: int, prompt: str) -> float:
        """Frames added to the RoPE position of the chunk's frames (0 here; may be fractional)."""
        return 0

    def recent_window_tokens(self) -> int | None:
        """Recent-window sampling of the transformer call being made (None: the whole
        window); LingBot-World varies it per chunk."""
        return self.settings.recent_window_tokens

    def begin_chunk(self, chunk_index: int, prompt: str, latents: torch.Tensor) -> None:
        """Called before a chunk is denoised; ``latents`` holds the clean frames so far."""

    def end_chunk(self, chunk_index: int, prompt: str) -> None:
        """Called after a chunk's context pass (LongLive 2.0 pins a scene cut here)."""

    # ---- the transformer calls -----------------------------------------------------------
    def _conditioning(self, cs: CacheSet, prompt: str) -> torch.Tensor:
        """Prompt embeddings for ``prompt``; a new prompt empties ``cs``'s cross caches."""
        if cs.prompt != prompt:
            cs.reset_cross()
            cs.prompt = prompt
        return self.encode_prompt(prompt)

    def _forward(
        self,
        cs: CacheSet,
        prompt: str,
        latents: torch.Tensor,
        timestep: float,
        token_start: int,
        rope_frame_start: float,
    ) -> torch.Tensor:
        return self.denoiser(
            latents,
            timestep,
            self._conditioning(cs, prompt),
            kv_caches=cs.kv,
            cross_caches=cs.cross,
            token_start=token_start,
            rope_frame_start=rope_frame_start,
            recent_window_tokens=self.recent_window_tokens(),
        )

    def predict(
        self, prompt: str, latents: torch.Tensor, timestep: float, token_start: int, rope_frame_start: float
    ) -> torch.Tensor:
        """Flow prediction ``[B, C, F, h, w]`` for one denoising step (one branch here)."""
        return self._forward(self.caches, prompt, latents, timestep, token_start, rope_frame_start)

    def context_pass(
        self, prompt: str, latents: torch.Tensor, token_start: int, rope_frame_start: float
    ) -> torch.Tensor:
        """Rewrite the chunk's K/V from the clean ``latents`` at ``context_noise`` (all branches)."""
        return self._forward(
            self.caches, prompt, latents, self.context_noise, token_start, rope_frame_start
        )

    # ---- the loop ------------------------------------------------------------------------------
    def _noise_like(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=generator.device)
        return noise.to(x.device)

    def denoise_chunk(
        self,
        chunk_index: int,
        prompt: str,
        x: torch.Tensor,
        token_start: int,
        rope_frame_start: float,
        *,
        generator: torch.Generator,
        on_forward: Callable[[ForwardRecord], None] | None = None,
    ) -> torch.Tensor:
        """Denoise one chunk's noise ``x`` ``[B, C, F, h, w]``; its clean latents (float32).

        The DMD loop: each step predicts ``x0 = x - sigma * pred`` and re-noises it to the next
        sigma with ``generator``. Stages with another sampler override this.
        """
        x0 = x
        steps = len(self.timesteps)
        for j in range(steps):
            t, sigma = self.timesteps[j], self.sigmas[j]
            pred = self.predict(prompt, x, t, token_start, rope_frame_start)
            x0 = x - sigma * pred
            if on_forward is not None:
                on_forward(ForwardRecord(chunk_index, j, t, x, pred, token_start, rope_frame_start))
            if j + 1 < steps:
                s_next = self.sigmas[j + 1]
                x = (1.0 - s_next) * x0 + s_next * self._noise_like(x0, generator)
        return x0

    def check_finite(self, x0: torch.Tensor, chunk_index: int, num_chunks: int) -> None:
        """`NonFiniteLatentsError` when chunk ``chunk_index``'s clean latents hold NaN or inf
        (one host sync per chunk): the run stops there instead of writing a black video."""
        if bool(torch.isfinite(x0).all()):
            return
        bad = int((~torch.isfinite(x0)).sum())
        hint = (
            f"lower --guidance-scale (it is {self.server_args.guidance_scale:g})"
            if self.num_branches() > 1
            else "check the model's timesteps, shift and weights"
        )
        raise NonFiniteLatentsError(
            f"the latents of chunk {chunk_index} (0-based, of {num_chunks}) are not finite ({bad:,} of "
            f"{x0.numel():,} values are NaN or inf); the run stops and nothing is written; {hint}"
            + (", or compute in --dtype float32" if self.denoiser.dtype != torch.float32 else ""),
            chunk=chunk_index, num_chunks=num_chunks,
        )

    @torch.no_grad()
    def generate(
        self,
        noise: torch.Tensor,
        chunk_prompts: Sequence[str],
        *,
        generator: torch.Generator,
        on_chunk_done: Callable[[int, Mapping[str, Any]], None] | None = None,
        on_forward: Callable[[ForwardRecord], None] | None = None,
    ) -> GenerationResult:
        """Generate every chunk of ``noise`` ``[B, C, F, h, w]`` (one prompt per chunk).

        Each chunk: ``len(timesteps)`` denoising calls (the first advances the caches, the
        rest rewrite), then the context pass. ``generator`` draws the re-noising noise, so a
        seed fixes the whole run. ``on_chunk_done(i, stats)`` runs after each chunk;
        ``on_forward`` sees every transformer call (`ForwardRecord`).
        """
        b, _c, num_frames, _h, _w = noise.shape
        if b != self.batch_size:
            raise ConfigError(f"noise batch {b} does not match the stage's batch_size={self.batch_size}")
        self.check_request(self.model, self.server_args, num_frames, list(chunk_prompts))
        self.reset()
        fpc = self.settings.frames_per_chunk
        out = torch.zeros(noise.shape, dtype=torch.float32, device=noise.device)
        stats_all: list[dict[str, Any]] = []
        for i, prompt in enumerate(chunk_prompts):
            t0 = time.perf_counter()
            f0 = i * fpc
            self.begin_chunk(i, prompt, out)
            token_start = self._token_end
            rope_f0 = f0 + self.rope_frame_offset(i, prompt)
            x = noise[:, :, f0 : f0 + fpc].float()
            x0 = self.denoise_chunk(i, prompt, x, token_start, rope_f0, generator=generator, on_forward=on_forward)
            self.check_finite(x0, i, len(chunk_prompts))
            out[:, :, f0 : f0 + fpc] = x0
            ctx_in = x0
            if self.context_noise > 0:
                s_ctx = self.context_noise / 1000.0
                ctx_in = (1.0 - s_ctx) * x0 + s_ctx * self._noise_like(x0, generator)
            ctx_pred = self.context_pass(prompt, ctx_in, token_start, rope_f0)
            if on_forward is not None:
                on_forward(ForwardRecord(i, -1, self.context_noise, ctx_in, ctx_pred, token_start, rope_f0))
            self._token_end = token_start + fpc * self.settings.tokens_per_frame
            self._cache_frames.extend((f, f + rope_f0 - f0) for f in range(f0, f0 + fpc))
            self.end_chunk(i, prompt)
            stats = {
                "chunk": i,
                "frames": [f0, f0 + fpc],
                "token_start": token_start,
                "rope_frame_start": rope_f0,
                "prompt": prompt,
                "seconds": time.perf_counter() - t0,
                "kv_resident_bytes": self.kv_resident_nbytes(),
                "visible_tokens": self.caches.kv[0]
                .get_attention_kv(recent_window_tokens=self.recent_window_tokens())
                .num_visible,
            }
            stats_all.append(stats)
            if on_chunk_done is not None:
                on_chunk_done(i, stats)
        return GenerationResult(latents=out, chunk_stats=stats_all)
