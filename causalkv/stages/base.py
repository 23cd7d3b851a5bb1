"""`CausalDenoisingStage`: a model family's denoising stage, assembled from small pieces.

- `causalkv.stages.planning.StagePlanning` (its base class): what the stage declares and
  checks before any weights load: capabilities, option records, the sampler
  (`causalkv.stages.scheduler.SchedulerSpec`), stream settings (`causalkv.stages.settings`),
  one prompt per chunk;
- this module: the run-time half: construction over a denoiser, a scheduler, a cache factory
  and a prompt encoder, the per-chunk hooks a family overrides (``begin_chunk``,
  ``rope_frame_offset``, ``predict``, ``context_pass``, ``end_chunk``, ...) and the
  transformer calls;
- `causalkv.stages.cache_sets`: the caches, allocated once on first use;
- `causalkv.stages.loop.ChunkLoop` (``stage.loop``): the chunk loop the host runs
  (``stage.loop.run``), which owns the stream's state (token end, frames held) and yields
  typed `causalkv.stages.records.ChunkStats`.

The loop (docs/design.md, "Flow"): for each chunk of ``frames_per_chunk`` latent frames and
each denoising timestep, run the transformer on the chunk at its global token start (the
first call advances every layer's cache, later calls rewrite the chunk in place), predict
``x0`` from the flow prediction, and re-noise ``x0`` to the next timestep with the seeded
generator. After the last step a context pass at ``context_noise`` writes the chunk's clean
K/V. Cross-attention K/V are computed once per prompt and cached per layer.

The stage knows nothing about diffusers or the runtime: it drives a `ChunkDenoiser` (the
runtime's causal Wan transformer, or any object with the same call) and the scheduler it
declares (``set_timesteps(sigmas=...)``, ``sigmas``, ``timesteps``).

Latent layout throughout: ``[B, C, F, h, w]`` (batch, latent channels, latent frames, latent
height, latent width), float32 outside the transformer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import torch

from causalkv.caches.cross import CrossAttentionKVCache
from causalkv.caches.ledger import peak_nbytes
from causalkv.caches.passes import PassMarker
from causalkv.caches.spec import CausalCacheSpec, CausalKVCache
from causalkv.capabilities import PROBE_COMMIT
from causalkv.errors import UsageError
from causalkv.options import CacheOptions, StageOptions, cache_record_for
from causalkv.stages.cache_sets import CacheSet
from causalkv.stages.loop import ChunkLoop, renoise
from causalkv.stages.planning import StagePlanning
from causalkv.stages.records import ForwardRecord

if TYPE_CHECKING:
    from causalkv.config import ModelConfig, ServerArgs
    from causalkv.hooks import CacheFactory

__all__ = ["CausalDenoisingStage", "ChunkDenoiser"]


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


class CausalDenoisingStage(StagePlanning):
    """Base stage: runs a causal transformer chunk by chunk over per-layer KV caches.

    A stage is the home of its model family's behaviour; its `StageRegistration` (in the same
    module) names the models it serves, their config defaults, tiny presets and the family's
    option records.

    Load-time declarations and request planning are the classmethods of `StagePlanning`
    (read by the resolver and the host before any weights load). Run time: build with the
    model config, the server args, the transformer, the scheduler, the cache factory and a
    prompt encoder; the host may apply `causalkv_configure_stage` overrides
    (`apply_overrides`) before the caches are allocated on first use; then run
    ``stage.loop.run`` (its `ChunkLoop`) once per request (the caches are reset each time).
    `report()` adds the stage's own entries to the run report.
    """

    # ---- construction ------------------------------------------------------------------------
    def __init__(
        self,
        model: ModelConfig,
        server_args: ServerArgs,
        *,
        denoiser: ChunkDenoiser,
        scheduler: Any,
        cache_factory: CacheFactory,
        encode_prompt: Callable[[str], torch.Tensor],
        batch_size: int = 1,
        negative_prompt: str = "",
        name: str | None = None,
        options: StageOptions | None = None,
        cache_options: CacheOptions | None | Any = ...,
    ) -> None:
        """Build the stage; its caches are allocated on first use (`cache_sets`).

        Args:
            model: the model config (geometry, chunking, sink/window, schedule).
            server_args: quant config, overrides, multi-shot, seed, guidance.
            denoiser: the causal transformer (see `ChunkDenoiser`).
            scheduler: a diffusers flow-matching scheduler (``FlowMatchEulerDiscreteScheduler``
                with ``shift = model.shift``).
            cache_factory: builds one layer's cache: ``build(spec, cache_options)``.
            encode_prompt: text -> prompt embeddings ``[B, L, text_dim]``.
            batch_size: B of the latents and caches.
            negative_prompt: text of the negative branch of stages that run CFG.
            name: the stage's registration name (default: the class name).
            options: the request's record of the family's knobs (``StageRegistration.options``;
                the host passes `Resolution.stage_options`); the stage reads its knobs there.
            cache_options: the settings record each cache is built with
                (``cache_factory.build(spec, cache_options)``); default: the request's record
                of the factory's ``options`` class (`causalkv.options.cache_record_for`).
        """
        self.name = name or type(self).__name__
        #: the request's record of this family's knobs (``StageRegistration.options``), or None
        self.options = options
        if cache_options is ...:
            cache_options = cache_record_for(cache_factory, server_args.options)
        #: the settings record the caches are built with (e.g. a `QVGKVQuantArgs`), or None
        self.cache_options = cache_options
        self.server_args = server_args
        self.denoiser = denoiser
        self.scheduler = scheduler
        self.cache_factory = cache_factory
        self.encode_prompt = encode_prompt
        self.batch_size = batch_size
        self.negative_prompt = negative_prompt
        self._cache_sets: list[CacheSet] | None = None
        self.apply_model(model)
        #: the chunk loop, the one owner of the stream's state (``loop.token_end``, ...)
        self.loop = ChunkLoop(self)
        self._reset_stream()

    def apply_model(self, model: ModelConfig) -> None:
        """(Re)derive everything that depends on the model config. Only before caches exist.

        Raises `UsageError` (a RuntimeError) once the caches are allocated, and `ConfigError` (stage left as
        it was) when the config gives invalid stream settings.
        """
        if self._cache_sets is not None:
            raise UsageError(
                f"stage {self.name!r}: its KV caches are already allocated; apply model "
                "overrides before the first chunk (causalkv_configure_stage does)"
            )
        self.model, self.settings = model, self.stream_settings(model, self.server_args)
        self.context_noise = float(model.context_noise)
        # one chunk's denoising (``len(sigmas)`` may be one more): `sampler_sigmas` as the
        # scheduler sets them (shifted)
        self.scheduler.set_timesteps(sigmas=self.sampler_sigmas(model))
        self.timesteps = [float(t) for t in self.scheduler.timesteps]
        self.sigmas = [float(s) for s in self.scheduler.sigmas]

    def sampler_sigmas(self, model: ModelConfig) -> Any:
        """The unshifted sigmas of one chunk's denoising: the DMD schedule, the model's
        timesteps as ``t / 1000``."""
        return [float(t) / 1000.0 for t in model.timesteps]

    def apply_overrides(self, overrides: Mapping[str, Any]) -> None:
        """Apply `ModelConfig` overrides (``causalkv_configure_stage``) to this stage: field
        names, and keys of the family's config record (`ModelConfig.with_overrides`)."""
        if overrides:
            self.apply_model(self.model.with_overrides(overrides))

    def kv_spec(self) -> CausalCacheSpec:
        """One layer's `CausalCacheSpec` under the current settings, for the denoiser's heads
        (a head-sharded rank's, starting at its ``head_offset``), in the KV dtype
        (``server_args.kv_cache_dtype``, else the denoiser's)."""
        name = self.server_args.kv_cache_dtype
        return self.settings.kv_spec(
            batch_size=self.batch_size,
            num_heads=self.denoiser.num_heads,
            head_dim=self.denoiser.head_dim,
            dtype=self.denoiser.dtype if name is None else getattr(torch, name),
            device=self.denoiser.device,
            head_offset=getattr(self.denoiser, "head_offset", 0),
        )

    @classmethod
    def branches_for(cls, guidance_scale: float) -> int:
        """Cache sets this stage runs at ``guidance_scale``: 2 on a CFG stage
        (`supports_guidance`) above 1, the negative branch's after the positive's; else 1.
        The host's memory floor counts the caches by it before the stage is built."""
        return 2 if cls.supports_guidance() and guidance_scale > 1.0 else 1

    def num_branches(self) -> int:
        """Cache sets this stage runs (`branches_for` its ``guidance_scale``)."""
        return self.branches_for(self.server_args.guidance_scale)

    def cache_sets(self) -> list[CacheSet]:
        """Every cache set this stage owns (the positive branch first); allocated on first use."""
        if self._cache_sets is None:
            spec, layers = self.kv_spec(), self.denoiser.num_layers
            self._cache_sets = [  # per branch: a causal KV cache and a cross cache per layer
                CacheSet([self.cache_factory.build(spec, self.cache_options) for _ in range(layers)],
                         [CrossAttentionKVCache() for _ in range(layers)])
                for _ in range(self.num_branches())
            ]
            caches = [c for cs in self._cache_sets for c in cs.kv]
            if caches and all(PROBE_COMMIT in getattr(c, "capabilities", ()) for c in caches):
                # the denoising passes are probes and the context pass commits: the chunk
                # being generated is stored once it is final, in its tier at once
                self.marker = PassMarker()
                for cache in caches:
                    cache.use_marker(self.marker)
        return self._cache_sets

    #: the `PassMarker` the stage's caches share once they all take one
    marker: PassMarker | None = None

    def pins_after_context(self) -> bool:
        """True when the chunk whose context pass runs now is pinned as the shot sink right
        after it (LongLive 2.0's scene cuts); its caches then give it a pinned chunk's tier."""
        return False

    def probe_scope(self) -> AbstractContextManager[Any]:
        """The context of the denoising passes: their writes are probes (`PassMarker.probing`);
        nothing without a marker."""
        self.cache_sets()  # built on first use: the marker comes with them
        return nullcontext() if self.marker is None else self.marker.probing()

    def context_scope(self, next_tokens: int | None = None) -> AbstractContextManager[Any]:
        """The context of a context-update pass: its writes commit the chunk
        (`PassMarker.committing`, with the pin the stage makes right after and the next
        chunk's size, default this one's); nothing without a marker."""
        self.cache_sets()
        if self.marker is None:
            return nullcontext()
        return self.marker.committing(pin=self.pins_after_context(), next_tokens=next_tokens)

    @property
    def caches(self) -> CacheSet:
        """The positive branch's caches."""
        return self.cache_sets()[0]

    def report(self) -> dict[str, Any]:
        """What this stage adds to the run report (LongLive 2.0: ``pinned_chunks``, ...)."""
        return {}

    def _reset_stream(self) -> None:
        """Reset the stage's own per-request state (a subclass's records; nothing here)."""

    def reset(self) -> None:
        """Forget the stream (new request): every self- and cross-attention cache is emptied,
        the loop's stream restarts, the stage's own per-request state is reset."""
        if self._cache_sets is not None:
            for cs in self._cache_sets:
                cs.reset()
        if self.marker is not None:
            self.marker.ledger.reset_peaks()
        self.loop.restart()
        self._reset_stream()

    def kv_resident_nbytes(self) -> int:
        """Bytes all self-attention caches of all branches hold now."""
        return sum(cache.resident_nbytes() for cs in self.cache_sets() for cache in cs.kv)

    def kv_peak_nbytes(self) -> int:
        """The most the self-attention caches held at once since the request began: with a
        marker its ledger (every layer and branch, plus the largest one-call buffer a view or
        a probe filled), else the bytes held now (a preallocated cache holds its most from
        the first chunk on)."""
        marker = self.marker
        return peak_nbytes([] if marker is None else [marker.ledger], self.kv_resident_nbytes())

    # ---- per-chunk policy (subclasses override) ------------------------------------------
    def rope_frame_offset(self, chunk_index: int, prompt: str) -> float:
        """Frames added to the RoPE position of the chunk's frames (0 here; may be fractional)."""
        return 0

    def recent_window_tokens(self) -> int | None:
        """Recent-window sampling of the transformer call being made (None: the whole
        window); LingBot-World varies it per chunk."""
        return self.settings.recent_window_tokens

    def begin_request(self, chunk_prompts: Sequence[str]) -> None:
        """Called first by `ChunkLoop.run` with the request's chunk prompts (LongLive 2.0
        reads its shot layout here)."""

    def begin_chunk(self, chunk_index: int, prompt: str, latents: torch.Tensor) -> None:
        """Called before a chunk is denoised; ``latents`` holds the clean frames so far."""

    def end_chunk(self, chunk_index: int, prompt: str) -> None:
        """Called after a chunk's context pass (LongLive 2.0 pins a scene cut here)."""

    # ---- the transformer calls -----------------------------------------------------------
    def _forward(
        self,
        cs: CacheSet,
        prompt: str,
        latents: torch.Tensor,
        timestep: float,
        token_start: int,
        rope_frame_start: float,
    ) -> torch.Tensor:
        """One transformer call on branch ``cs`` with ``prompt``'s embeddings; a new prompt
        empties ``cs``'s cross caches first."""
        if cs.prompt != prompt:
            cs.reset_cross()
            cs.prompt = prompt
        return self.denoiser(
            latents,
            timestep,
            self.encode_prompt(prompt),
            kv_caches=cs.kv,
            cross_caches=cs.cross,
            token_start=token_start,
            rope_frame_start=rope_frame_start,
            recent_window_tokens=self.recent_window_tokens(),
        )

    def _branches(self, prompt: str, latents: torch.Tensor, timestep: float, token_start: int,
                  rope_frame_start: float) -> list[torch.Tensor]:
        """One `_forward` per cache set: the positive branch with ``prompt``, a CFG stage's
        negative branch (`num_branches` 2) with ``negative_prompt``."""
        return [self._forward(cs, p, latents, timestep, token_start, rope_frame_start)
                for cs, p in zip(self.cache_sets(), (prompt, self.negative_prompt))]

    def predict(
        self, prompt: str, latents: torch.Tensor, timestep: float, token_start: int, rope_frame_start: float
    ) -> torch.Tensor:
        """Flow prediction ``[B, C, F, h, w]`` for one denoising step: the positive branch's,
        with CFG ``neg + guidance_scale * (pos - neg)``."""
        pos, *neg = self._branches(prompt, latents, timestep, token_start, rope_frame_start)
        if not neg:
            return pos
        return neg[0] + float(self.server_args.guidance_scale) * (pos - neg[0])

    def context_pass(
        self, prompt: str, latents: torch.Tensor, token_start: int, rope_frame_start: float
    ) -> torch.Tensor:
        """Rewrite the chunk's K/V from the clean ``latents`` at ``context_noise`` (all branches),
        inside `context_scope`; the positive branch's prediction."""
        with self.context_scope():
            return self._branches(prompt, latents, self.context_noise, token_start,
                                  rope_frame_start)[0]

    # ---- the sampler ---------------------------------------------------------------------------
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
        """Denoise one chunk's noise ``x`` ``[B, C, F, h, w]``; its clean latents (float32):
        per timestep one `predict`, then one `sampler_step`."""
        for j, t in enumerate(self.timesteps):
            pred = self.predict(prompt, x, t, token_start, rope_frame_start)
            if on_forward is not None:
                on_forward(ForwardRecord(chunk_index, j, t, x, pred, token_start, rope_frame_start))
            x = self.sampler_step(j, x, pred, generator)
        return x

    def sampler_step(
        self, j: int, x: torch.Tensor, pred: torch.Tensor, generator: torch.Generator
    ) -> torch.Tensor:
        """The latents after step ``j`` of the sampler, from ``x`` and its prediction.

        The DMD sampler: ``x0 = x - sigma * pred``, re-noised to the next sigma with
        ``generator`` (``x0`` itself after the last step). Stages with another sampler
        override this.
        """
        x0 = x - self.sigmas[j] * pred
        if j + 1 == len(self.timesteps):
            return x0
        return renoise(x0, self.sigmas[j + 1], generator)
