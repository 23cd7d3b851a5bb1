"""Causal attention for diffusers' `WanTransformer3DModel`, installed through its processor API.

`install_causal_processors(transformer)` swaps every block's processors with
``transformer.set_attn_processor``: self-attention (``attn1``) goes through
`CausalWanSelfAttnProcessor`, which writes the chunk's post-RoPE K/V into the layer's causal
cache and attends over the cache's view with `causalkv.caches.attend`; cross-attention
(``attn2``) goes through `CachedWanCrossAttnProcessor`, which computes the text K/V once per
prompt. Weights are untouched, so any diffusers-format Wan checkpoint loads with
``from_pretrained`` and runs causally.

RoPE: keys are cached after RoPE, so each chunk's frames must be rotated at their global
frame position. diffusers' model computes RoPE for frames ``[0, F)`` of its input; the
processors ignore that and use `rope_at_frame_offset` for ``[f0, f0 + F)`` instead.

Per call state (which caches, the token start, the RoPE tables) lives in one `CausalCallState`
shared by all processors of a model; `CausalWanTransformer.__call__` fills it.

Layouts: hidden states ``[B, S, H*D]``; q/k/v ``[B, S, H, D]``; RoPE tables ``[1, S, 1, D]``.

Sequence parallel (`CausalWanTransformer.enable_sequence_parallel`, N ranks): each rank's
hidden states hold ``S/N`` tokens; the self-attention processor exchanges q/k/v to
``[B, S, H/N, D]`` (every token, this rank's heads) with one all-to-all, rotates them with the
whole chunk's RoPE table, writes and reads the rank's caches (``H/N`` heads) and exchanges the
output back to ``[B, S/N, H, D]``. Cross-attention runs on the rank's tokens unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from causalkv.caches.attention import AttendStats, attend
from causalkv.caches.cross import CrossAttentionKVCache
from causalkv.caches.spec import CausalKVCache
from causalkv.errors import ConfigError, UsageError
from causalkv.memory.geometry import frame_tokens
from causalkv.runtime.model_io.prompt_encoding import warn_line
from causalkv.runtime.processes.distributed import (
    ParallelContext,
    enable_sequence_parallel,
    heads_to_seq,
    seq_to_heads,
)

__all__ = [
    "CachedWanCrossAttnProcessor",
    "CausalCallState",
    "CausalWanSelfAttnProcessor",
    "CausalWanTransformer",
    "apply_rotary",
    "install_causal_processors",
    "report_attend",
    "rope_at_frame_offset",
    "rope_temporal_at",
]


def report_attend(stats: AttendStats) -> None:
    """Say each reason `attend` recorded for decoding packed segments before attention
    (``stats.decode_reasons``) in one ``causalkv: warning:`` line, once per process: the cache
    layer records them, the host reports them."""
    for reason in stats.unreported():
        warn_line(f"attention: {reason}")


def rope_at_frame_offset(
    rope: torch.nn.Module, num_frames: int, height: int, width: int, frame_offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's 3-D RoPE tables for latent frames ``[frame_offset, frame_offset + num_frames)``.

    ``rope`` is the model's ``WanRotaryPosEmbed``; ``height``/``width`` are latent sizes
    (before patchify). For an integer ``frame_offset`` this equals rows ``[f0 * hw, (f0 + F)
    * hw)`` of ``rope`` applied to a video of ``f0 + F`` frames (``hw`` = patches per frame),
    read from its precomputed tables. A fractional ``frame_offset`` (LongLive 2.0's per-shot
    offset) is a continuous position: the temporal part is ``cos``/``sin`` of ``position x
    frequency`` computed in float64 (`rope_temporal_at`), the spatial parts are the tables'.

    Returns ``(cos, sin)``, each ``[1, F * h' * w', 1, D]`` (float32 on the tables' device).
    """
    p_t, p_h, p_w = rope.patch_size
    ppf, pph, ppw = num_frames // p_t, height // p_h, width // p_w
    integral = float(frame_offset).is_integer()
    f0 = int(frame_offset) // p_t if integral else float(frame_offset) / p_t
    if f0 < 0:
        raise ConfigError(f"RoPE frame offset must be >= 0, got {frame_offset}")
    if f0 + ppf > rope.max_seq_len:
        raise ConfigError(
            f"RoPE frames [{f0}, {f0 + ppf}) exceed the model's rope_max_seq_len={rope.max_seq_len}; "
            "generate fewer frames or raise rope_max_seq_len in transformer/config.json"
        )
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    temporal = None if integral else rope_temporal_at(rope, f0 + torch.arange(ppf, dtype=torch.float64))
    tables = []
    for k, freqs in enumerate((rope.freqs_cos, rope.freqs_sin)):
        f_t, f_h, f_w = freqs.split(split, dim=1)
        t_rows = f_t[f0 : f0 + ppf] if temporal is None else temporal[k].to(f_t.device, f_t.dtype)
        parts = [
            t_rows.view(ppf, 1, 1, -1).expand(ppf, pph, ppw, -1),
            f_h[:pph].view(1, pph, 1, -1).expand(ppf, pph, ppw, -1),
            f_w[:ppw].view(1, 1, ppw, -1).expand(ppf, pph, ppw, -1),
        ]
        tables.append(torch.cat(parts, dim=-1).reshape(1, ppf * pph * ppw, 1, -1))
    return tables[0], tables[1]


def rope_temporal_at(rope: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temporal RoPE ``(cos, sin)`` ``[P, t_dim]`` (float64) at (fractional) ``positions`` ``[P]``.

    The formula of diffusers' ``get_1d_rotary_pos_embed`` (``use_real``,
    ``repeat_interleave_real``) that builds ``WanRotaryPosEmbed``'s tables: frequency
    ``theta ** (-2i / t_dim)`` (``theta`` = the module's ``theta``, Wan's 10000 when it has
    none), angle = position x frequency, each cos/sin repeated twice.
    """
    dim = int(rope.t_dim)
    theta = float(getattr(rope, "theta", 10000.0))
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(positions.to(torch.float64), freqs)
    return angles.cos().repeat_interleave(2, dim=1), angles.sin().repeat_interleave(2, dim=1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, S, H, D]`` by interleaved-pair RoPE (diffusers' Wan formula)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c = cos[..., 0::2]
    s = sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


@dataclass
class CausalCallState:
    """What the processors need for the current transformer call.

    Attributes:
        kv_caches: one causal cache per layer (self-attention).
        cross_caches: one cross-attention cache per layer.
        token_start: global position of the chunk's first token in the caches.
        rope: ``(cos, sin)`` ``[1, S, 1, D]`` for the chunk's frames.
        recent_window_tokens: LingBot-World recent window, or None.
        active: False outside `CausalWanTransformer.__call__` (the processors refuse to run).
        parallel: the sequence-parallel context (None: one process).
    """

    kv_caches: Sequence[CausalKVCache] = ()
    cross_caches: Sequence[CrossAttentionKVCache] = ()
    token_start: int = 0
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    recent_window_tokens: int | None = None
    active: bool = False
    parallel: ParallelContext | None = None
    #: views returned by the last call's writes, per layer (for inspection in tests)
    last_positions: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)


def _heads(attn: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
    return t.unflatten(2, (attn.heads, -1))


class _WanProcessor(ABC):
    """A processor of one Wan block's attention (diffusers' processor call), run only inside
    `CausalWanTransformer.__call__`, which fills the shared `CausalCallState`."""

    def __init__(self, layer_index: int, state: CausalCallState) -> None:
        self.layer_index = layer_index
        self.state = state

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if not self.state.active:
            raise UsageError(
                f"{type(self).__name__} called outside CausalWanTransformer.__call__; "
                "call the wrapper with the layer caches, not the diffusers model directly"
            )
        out = self.attend(attn, hidden_states, encoder_hidden_states).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))

    @abstractmethod
    def attend(self, attn: torch.nn.Module, hidden_states: torch.Tensor,
               encoder_hidden_states: torch.Tensor | None) -> torch.Tensor:
        """The attention output ``[B, S, H, D]`` before the output projection."""


class CausalWanSelfAttnProcessor(_WanProcessor):
    """Self-attention of one Wan block over the layer's causal KV cache.

    q/k/v are projected and RMS-normed as in diffusers' ``WanAttnProcessor``, rotated at the
    chunk's frame offset, the chunk's K/V ``[B, n, H, D]`` are written at ``token_start``
    (advance or rewrite) and the query attends over the returned view (never reading
    ``view.k``/``view.v`` directly, so a packed view streams segment by segment).
    """

    def attend(self, attn: torch.nn.Module, hidden_states: torch.Tensor,
               encoder_hidden_states: torch.Tensor | None) -> torch.Tensor:
        st = self.state
        query = _heads(attn, attn.norm_q(attn.to_q(hidden_states)))
        key = _heads(attn, attn.norm_k(attn.to_k(hidden_states)))
        value = _heads(attn, attn.to_v(hidden_states))
        par = st.parallel
        if par is not None:  # [B, S/N, H, D] -> [B, S, H/N, D]: one all-to-all for q, k and v
            qkv = seq_to_heads(torch.cat((query, key, value), dim=-1), par)
            query, key, value = qkv.chunk(3, dim=-1)
        cos, sin = st.rope  # the chunk's frames, as diffusers patchified them: one row per token
        query = apply_rotary(query, cos, sin)
        cache = st.kv_caches[self.layer_index]
        dtype = cache.spec.dtype
        view = cache.update_and_get_attention_kv(
            key=apply_rotary(key, cos, sin).to(dtype),
            value=value.to(dtype),
            current_chunk_start=st.token_start,
            recent_window_tokens=st.recent_window_tokens,
            debug_name=f"blocks.{self.layer_index}.attn1",
        )
        st.last_positions[self.layer_index] = tuple(view.position_ranges)
        stats = AttendStats()
        out = attend(query.to(dtype), view, stats=stats).to(query.dtype)
        report_attend(stats)
        return out if par is None else heads_to_seq(out, par)  # [B, S, H/N, D] -> [B, S/N, H, D]


class CachedWanCrossAttnProcessor(_WanProcessor):
    """Cross-attention of one Wan block with the text K/V cached per prompt.

    On the first call after a reset the text K/V ``[B, L, H, D]`` are projected from
    ``encoder_hidden_states`` and stored in the layer's `CrossAttentionKVCache`; later calls
    reuse them.
    """

    def attend(self, attn: torch.nn.Module, hidden_states: torch.Tensor,
               encoder_hidden_states: torch.Tensor | None) -> torch.Tensor:
        cache = self.state.cross_caches[self.layer_index]
        if not cache.is_initialized:
            assert encoder_hidden_states is not None
            k = _heads(attn, attn.norm_k(attn.to_k(encoder_hidden_states)))
            v = _heads(attn, attn.to_v(encoder_hidden_states))
            cache.store(k, v)
        k, v = cache.get()
        query = _heads(attn, attn.norm_q(attn.to_q(hidden_states)))
        return F.scaled_dot_product_attention(
            query.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        ).transpose(1, 2).type_as(query)


def install_causal_processors(transformer: torch.nn.Module) -> CausalCallState:
    """Install the causal processors on every block of ``transformer``; return their state.

    Uses the model's processor API (``set_attn_processor`` with a name -> processor dict).
    Raises ValueError for image-conditioned Wan variants (``added_kv_proj_dim``), whose
    cross-attention also reads image tokens.
    """
    if getattr(transformer.config, "added_kv_proj_dim", None) is not None:
        raise ConfigError(
            "image-conditioned Wan transformers (added_kv_proj_dim set) are not supported by "
            "the causal runtime; use a text-to-video Wan checkpoint"
        )
    state = CausalCallState()
    kinds = {"attn1": CausalWanSelfAttnProcessor, "attn2": CachedWanCrossAttnProcessor}
    processors: dict[str, object] = {}
    for name in transformer.attn_processors:  # names look like "blocks.3.attn1.processor"
        _, layer, module, *_ = name.split(".")
        if module not in kinds:
            raise ConfigError(f"unexpected attention module {name!r} in the Wan transformer")
        processors[name] = kinds[module](int(layer), state)
    transformer.set_attn_processor(processors)
    return state


class CausalWanTransformer:
    """A diffusers `WanTransformer3DModel` run chunk by chunk over per-layer caches.

    Implements the stages' ``ChunkDenoiser`` call: latents ``[B, C, F, h, w]`` in, flow
    prediction ``[B, C, F, h, w]`` (float32) out.

    ``num_heads`` is the number of heads this process attends over and caches, the global
    ones ``[head_offset, head_offset + num_heads)`` (all of them on one process; ``H/N`` after
    `enable_sequence_parallel`).
    """

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.model = transformer.eval()
        cfg = transformer.config
        self.num_layers: int = int(cfg.num_layers)
        self.num_heads: int = int(cfg.num_attention_heads)
        self.head_offset: int = 0
        self.world_size: int = 1
        self.head_dim: int = int(cfg.attention_head_dim)
        self.patch_size: tuple[int, int, int] = tuple(cfg.patch_size)  # type: ignore[assignment]
        # the compute dtype: the first parameter may be one kept in float32 (scale_shift_table)
        param = transformer.patch_embedding.weight
        self.dtype: torch.dtype = param.dtype
        self.device: torch.device = param.device
        self.state = install_causal_processors(transformer)

    def enable_sequence_parallel(self, ctx: ParallelContext) -> None:
        """Run as one rank of ``ctx``: the sequence is split across ranks (diffusers'
        context-parallel hooks), this rank attends over and caches heads ``ctx.head_slice(H)``.

        Call once, before the stage allocates its caches (their spec reads ``num_heads`` and
        ``head_offset``). Every rank must make the same calls with the same latents.
        """
        if self.state.parallel is not None:
            raise UsageError("sequence parallelism is already enabled on this transformer")
        start, stop = ctx.head_slice(int(self.model.config.num_attention_heads))
        if ctx.world_size > 1:
            enable_sequence_parallel(self.model, ctx)
        self.num_heads, self.head_offset, self.world_size = stop - start, start, ctx.world_size
        self.state.parallel = ctx if ctx.world_size > 1 else None

    def tokens_per_frame(self, height: int, width: int) -> int:
        """Tokens per latent frame of latent size ``height`` x ``width``."""
        return frame_tokens(height, width, self.patch_size[1:])

    @torch.no_grad()
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
        b, c, f, h, w = latents.shape
        if len(kv_caches) != self.num_layers or len(cross_caches) != self.num_layers:
            raise ConfigError(
                f"need one cache per layer ({self.num_layers}), got {len(kv_caches)} KV and "
                f"{len(cross_caches)} cross-attention caches"
            )
        st = self.state
        cos, sin = rope_at_frame_offset(self.model.rope, f, h, w, rope_frame_start)
        st.rope = (cos.to(self.device), sin.to(self.device))
        st.kv_caches, st.cross_caches = kv_caches, cross_caches
        st.token_start = token_start
        st.recent_window_tokens = recent_window_tokens
        st.active = True
        try:
            return self.model(
                hidden_states=latents.to(device=self.device, dtype=self.dtype),
                timestep=torch.full((b,), float(timestep), device=self.device),
                encoder_hidden_states=prompt_embeds.to(device=self.device, dtype=self.dtype),
                return_dict=False,
            )[0].float()
        finally:
            st.active = False
            st.kv_caches = st.cross_caches = ()
