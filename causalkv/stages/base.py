"""`CausalDenoisingStage`: the chunk-by-chunk denoising loop and its load-time declarations.

The loop (ARCHITECTURE.md, "Flow"): for each chunk of ``frames_per_chunk`` latent frames and
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

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

if TYPE_CHECKING:
    from causalkv.config import ModelConfig, ServerArgs

__all__ = [
    "CacheSet",
    "CausalDenoisingStage",
    "ChunkDenoiser",
    "ForwardRecord",
    "GenerationResult",
    "StreamSettings",
]


class ChunkDenoiser(Protocol):
    """A transformer run causally over per-layer caches (the runtime's `CausalWanTransformer`).

    Attributes: ``num_layers``, ``num_heads``, ``head_dim``, ``dtype``, ``device``.
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
        rope_frame_start: int,
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

    Attributes:
        frames_per_chunk, tokens_per_frame: chunk geometry.
        sink_frames: the sink (LongLive 2.0: the pinned shot sink's size).
        global_sink_frames: the stream-start sink kept while a shot sink is pinned.
        window_frames: frames attention sees at most (sink and current chunk included).
        cache_frames: frames each cache retains.
        recent_window_frames: LingBot-World recent-window sampling, or None.
    """

    frames_per_chunk: int
    tokens_per_frame: int
    sink_frames: int
    global_sink_frames: int
    window_frames: int
    cache_frames: int
    recent_window_frames: int | None

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
    ) -> KVCacheSpec:
        """One layer's `KVCacheSpec` (all counts in tokens: frames x ``tokens_per_frame``)."""
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
    rope_frame_start: int
    branch: str = "positive"


@dataclass
class GenerationResult:
    """Clean latents ``[B, C, F, h, w]`` (float32) and one stats dict per chunk."""

    latents: torch.Tensor
    chunk_stats: list[dict[str, Any]] = field(default_factory=list)


def _positive_int(name: str, value: object, hint: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}; {hint}")
    return value


class CausalDenoisingStage:
    """Base stage: runs a causal transformer chunk by chunk over per-layer KV caches.

    Load-time declarations (read by the resolver before any weights load):

    - `_supports_qvg_kv_cache_quantization()`: may this stage run on a QVG-packed cache?
      False here; a stage opts in by overriding it.
    - `supports_multi_shot()`: may a request pin shot sinks (LongLive 2.0 scene cuts)?
    - `uses_recent_window(server_args, model)`: does it sample a recent window?
    - `required_cache_features(server_args, model)`: the cache capabilities it needs.

    Run time: build with the model config, the server args, the transformer, the scheduler,
    the cache factory and a prompt encoder, then call `generate` once per request (the
    caches are reset at the start of each request).
    """

    #: human-readable stage name (registrations use it too)
    stage_name: ClassVar[str] = "causal-denoising"

    # ---- load-time declarations -----------------------------------------------------------
    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return False

    @classmethod
    def supports_multi_shot(cls) -> bool:
        return False

    @classmethod
    def uses_recent_window(cls, server_args: ServerArgs, model: ModelConfig | None = None) -> bool:
        if server_args.recent_window_frames is not None:
            return True
        return model is not None and model.recent_window_frames is not None

    @classmethod
    def required_cache_features(
        cls, server_args: ServerArgs, model: ModelConfig | None = None
    ) -> frozenset[str]:
        """Cache capabilities this stage needs under ``server_args``."""
        req: set[str] = set()
        if server_args.kv_cache_quant_config.enabled:
            req.add(QUANT_QVG)
        if server_args.multi_shot:
            req.add(PINNED_SINK)
        if server_args.heads_sharded > 1:
            req.add(HEAD_SLICE)
        if cls.uses_recent_window(server_args, model):
            req.add(RECENT_WINDOW)
        return frozenset(req)

    @classmethod
    def stream_settings(cls, model: ModelConfig, server_args: ServerArgs) -> StreamSettings:
        """The effective sink / window / cache / recent window, validated (ValueError).

        ``server_args`` overrides (``sink_frames``, ``window_frames``,
        ``recent_window_frames``) win over the model config. Checked: counts are ints of
        the right sign, the window holds at least one chunk plus the sink (and, with
        multi-shot, the global sink plus a pinned shot sink), the cache holds the window.
        """
        fpc = _positive_int(
            "frames_per_chunk", model.frames_per_chunk, "fix frames_per_chunk in causalkv.json"
        )
        tpf = _positive_int(
            "tokens_per_frame", model.tokens_per_frame, "check the model's resolution and patch size"
        )
        sink = model.sink_frames if server_args.sink_frames is None else server_args.sink_frames
        if not isinstance(sink, int) or isinstance(sink, bool) or sink < 0:
            raise ValueError(f"sink frames must be an int >= 0, got {sink!r} (--sink-frames)")
        global_sink = model.global_sink_frames if model.global_sink_frames is not None else sink
        global_sink = min(global_sink, sink)
        window_overridden = server_args.window_frames is not None
        window = model.window_frames if not window_overridden else server_args.window_frames
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ValueError(f"window frames must be a positive int, got {window!r} (--window-frames)")
        if window < fpc:
            raise ValueError(
                f"window of {window} frames is smaller than a chunk of {fpc} frames; "
                f"pass --window-frames >= {fpc}"
            )
        pinned = cls.supports_multi_shot() and server_args.multi_shot
        max_sink = global_sink + sink if pinned else sink
        if window < max_sink + fpc:
            what = (
                f"the global sink ({global_sink}) plus a pinned shot sink ({sink})"
                if pinned
                else f"the sink ({sink})"
            )
            raise ValueError(
                f"window of {window} frames cannot hold {what} plus a chunk of {fpc} frames; "
                f"pass --window-frames >= {max_sink + fpc} or a smaller --sink-frames"
            )
        if window_overridden or model.cache_frames is None:
            cache = window
        else:
            cache = max(model.cache_frames, window)
        recent = (
            server_args.recent_window_frames
            if server_args.recent_window_frames is not None
            else model.recent_window_frames
        )
        if recent is not None and (not isinstance(recent, int) or isinstance(recent, bool) or recent < 0):
            raise ValueError(
                f"recent window frames must be an int >= 0, got {recent!r} (--recent-window-frames)"
            )
        return StreamSettings(
            frames_per_chunk=fpc,
            tokens_per_frame=tpf,
            sink_frames=sink,
            global_sink_frames=global_sink,
            window_frames=window,
            cache_frames=cache,
            recent_window_frames=recent,
        )

    @classmethod
    def check_request(
        cls,
        model: ModelConfig,
        server_args: ServerArgs,
        num_frames: int,
        chunk_prompts: Sequence[str] | None = None,
    ) -> StreamSettings:
        """Validate a request before any heavy work; return its `StreamSettings`.

        Raises ValueError when ``num_frames`` is not a positive multiple of
        ``frames_per_chunk``, when the prompt list is empty or holds an empty prompt, when
        it does not hold one prompt per chunk, or when the stream settings are invalid.
        """
        settings = cls.stream_settings(model, server_args)
        fpc = settings.frames_per_chunk
        if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames <= 0:
            raise ValueError(f"frames must be a positive int, got {num_frames!r} (--frames)")
        if num_frames % fpc:
            lo = num_frames - num_frames % fpc
            choices = f"{lo} or {lo + fpc}" if lo > 0 else f"{fpc}"
            raise ValueError(
                f"frames={num_frames} is not divisible by frames per chunk={fpc} of "
                f"{model.name}; pass --frames {choices}"
            )
        if chunk_prompts is not None:
            if len(chunk_prompts) == 0:
                raise ValueError("the prompt list is empty; pass at least one --prompt TEXT")
            for p in chunk_prompts:
                if not isinstance(p, str) or not p.strip():
                    raise ValueError(f"prompts must be non-empty text, got {p!r}")
            if len(chunk_prompts) != num_frames // fpc:
                raise ValueError(
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
    ) -> None:
        """Build the stage and its caches.

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
        """
        self.model = model
        self.server_args = server_args
        self.denoiser = denoiser
        self.scheduler = scheduler
        self.cache_factory = cache_factory
        self.encode_prompt = encode_prompt
        self.batch_size = batch_size
        self.negative_prompt = negative_prompt
        self.settings = self.stream_settings(model, server_args)
        self.context_noise = float(model.context_noise)
        self.quant = server_args.kv_cache_quant_config
        scheduler.set_timesteps(sigmas=[float(t) / 1000.0 for t in model.timesteps])
        self.timesteps: list[float] = [float(t) for t in scheduler.timesteps]
        self.sigmas: list[float] = [float(s) for s in scheduler.sigmas]
        self.caches = self._new_cache_set()
        self._reset_stream()

    def _new_cache_set(self) -> CacheSet:
        spec = self.settings.kv_spec(
            batch_size=self.batch_size,
            num_heads=self.denoiser.num_heads,
            head_dim=self.denoiser.head_dim,
            dtype=self.denoiser.dtype,
            device=self.denoiser.device,
        )
        kv = [self.cache_factory.build(spec, self.quant) for _ in range(self.denoiser.num_layers)]
        cross = [CrossAttentionKVCache() for _ in range(self.denoiser.num_layers)]
        return CacheSet(kv=kv, cross=cross)

    def cache_sets(self) -> list[CacheSet]:
        """Every cache set this stage owns (the positive branch first)."""
        return [self.caches]

    def _reset_stream(self) -> None:
        #: next token start in the caches' positions (== every cache's global_end)
        self._token_end = 0
        #: (frame, rope frame) of each latent frame the caches hold, in cache-position order
        self._cache_frames: list[tuple[int, int]] = []

    def reset(self) -> None:
        """Forget the stream (new request): every self- and cross-attention cache is emptied."""
        for cs in self.cache_sets():
            cs.reset()
        self._reset_stream()

    def kv_resident_nbytes(self) -> int:
        """Bytes all self-attention caches of all branches hold now."""
        return sum(cs.kv_resident_nbytes() for cs in self.cache_sets())

    @property
    def cache_name(self) -> str:
        return getattr(self.cache_factory, "name", type(self.cache_factory).__name__)

    # ---- per-chunk policy (subclasses override) ------------------------------------------
    def rope_frame_offset(self, chunk_index: int, prompt: str) -> int:
        """Frames added to the RoPE position of the chunk's frames (0 here)."""
        return 0

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
        rope_frame_start: int,
    ) -> torch.Tensor:
        return self.denoiser(
            latents,
            timestep,
            self._conditioning(cs, prompt),
            kv_caches=cs.kv,
            cross_caches=cs.cross,
            token_start=token_start,
            rope_frame_start=rope_frame_start,
            recent_window_tokens=self.settings.recent_window_tokens,
        )

    def predict(
        self, prompt: str, latents: torch.Tensor, timestep: float, token_start: int, rope_frame_start: int
    ) -> torch.Tensor:
        """Flow prediction ``[B, C, F, h, w]`` for one denoising step (one branch here)."""
        return self._forward(self.caches, prompt, latents, timestep, token_start, rope_frame_start)

    def context_pass(
        self, prompt: str, latents: torch.Tensor, token_start: int, rope_frame_start: int
    ) -> torch.Tensor:
        """Rewrite the chunk's K/V from the clean ``latents`` at ``context_noise`` (all branches)."""
        return self._forward(
            self.caches, prompt, latents, self.context_noise, token_start, rope_frame_start
        )

    # ---- the loop ------------------------------------------------------------------------------
    def _noise_like(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=generator.device)
        return noise.to(x.device)

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
            raise ValueError(f"noise batch {b} does not match the stage's batch_size={self.batch_size}")
        self.check_request(self.model, self.server_args, num_frames, list(chunk_prompts))
        self.reset()
        fpc = self.settings.frames_per_chunk
        out = torch.zeros(noise.shape, dtype=torch.float32, device=noise.device)
        stats_all: list[dict[str, Any]] = []
        steps = len(self.timesteps)
        for i, prompt in enumerate(chunk_prompts):
            t0 = time.perf_counter()
            f0 = i * fpc
            self.begin_chunk(i, prompt, out)
            token_start = self._token_end
            rope_f0 = f0 + self.rope_frame_offset(i, prompt)
            x = noise[:, :, f0 : f0 + fpc].float()
            x0 = x
            for j in range(steps):
                t, sigma = self.timesteps[j], self.sigmas[j]
                pred = self.predict(prompt, x, t, token_start, rope_f0)
                x0 = x - sigma * pred
                if on_forward is not None:
                    on_forward(ForwardRecord(i, j, t, x, pred, token_start, rope_f0))
                if j + 1 < steps:
                    s_next = self.sigmas[j + 1]
                    x = (1.0 - s_next) * x0 + s_next * self._noise_like(x0, generator)
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
                .get_attention_kv(recent_window_tokens=self.settings.recent_window_tokens)
                .num_visible,
            }
            stats_all.append(stats)
            if on_chunk_done is not None:
                on_chunk_done(i, stats)
        return GenerationResult(latents=out, chunk_stats=stats_all)
