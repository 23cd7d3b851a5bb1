"""vLLM-Omni's LingBot-World in the memory planner: request-mode bytes, and realtime sessions
admitted. Counted with causalkv's planner (`causalkv.memory`, below the bridges); imports no vLLM
or vLLM-Omni, so ``causalkv memory lingbot --host vllm-omni`` runs without them.

Two hosts of LingBot-World's self-attention K/V in vLLM-Omni 0.30.0:

**Request (direct) mode** (`plan_sessions`): per request, per layer ``[B, max_tokens, H, D]`` K
and V, ``max_tokens`` = 18 x 1,560 = 28,080 (``allocate_lingbot_cache``). With causalkv's store
(`causalkv.vllm_omni.lingbot_cache.LingBotLayerKV`) each layer holds the context at its tiers
(`plan_setting` for `STREAM_CACHE`) plus the chunk written last in bf16 (vLLM-Omni's context
write is unmarked): ``session_bytes = plan.kv_bytes + layers x plan.chunk_bytes``.

**Realtime sessions on the paged AR-diffusion engine** (`admit`, `plan_admission`: what
``causalkv memory lingbot --host vllm-omni`` prints and what causalkv's paged cache,
`causalkv.vllm_omni.paged_cache`, admits by: one formula). vLLM-Omni's ``ARDiffusionKVCache``
admits the largest session count ``N`` whose bytes fit the memory budget (free memory x
``gpu_memory_fraction``): the scratch pool, per session its cross-attention
caches and model-owned state, and ``local_branches x (N x (sink + window) + frames_per_block) +
2`` pool blocks (one latent frame, all layers, per block). `EngineGeometry` is what it reads;
`SessionLayout` is what one session holds between ticks:

- ``stock`` (`stock_layout`): ``sink + window`` bf16 frames, the oldest window group included,
  which no later forward reads (a forward reads ``sink + window`` frames, its own tick
  included);
- causalkv (`causalkv_layout`): the groups the next tick reads (`engine_stream`:
  `STREAM_CACHE`'s cursor, so no dead group), each at the tier `plan_setting` decides (the
  packing policy, the store's tier policy, the codec's ``nbytes``): bf16 groups as pool
  blocks, packed groups at their codec's bytes beside the pool.

LingBot-World's engine geometry (`lingbot_engine`) carries its declared text cache and
model-owned state (`lingbot_model_state_bytes`, vLLM-Omni's own per-session formula, checked
against the pipeline in the bridge suite). Weights and activations are outside the budget.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.config import DTYPE_BYTES
from causalkv.errors import ConfigError, check_int, is_number
from causalkv.memory.cache_models import STREAM_CACHE
from causalkv.memory.geometry import ModelGeometry
from causalkv.memory.layout import stream_layout
from causalkv.memory.plan import plan_setting
from causalkv.memory.records import (
    SETTINGS,
    MemoryRequest,
    Setting,
    StreamLayout,
    check_budget,
    format_bytes,
)

__all__ = [
    "ADMISSION_ROWS",
    "ENGINE_CACHE",
    "LINGBOT_STOCK_CAPACITY",
    "LINGBOT_TEXT_TOKENS",
    "ROWS",
    "VLLM_OMNI_LINGBOT",
    "Admission",
    "EngineGeometry",
    "SessionLayout",
    "SessionPlan",
    "admit",
    "causalkv_layout",
    "engine_stream",
    "format_admission",
    "lingbot_engine",
    "lingbot_model_state_bytes",
    "plan_admission",
    "plan_sessions",
    "required_bytes",
    "stock_layout",
]

#: vLLM-Omni 0.30.0's LingBot-World geometry (its transformer's checkpoint contract)
VLLM_OMNI_LINGBOT = ModelGeometry(
    "LingBot-World (vLLM-Omni 0.30.0)", 40, 40, 128, vae_scale_spatial=8, vae_scale_temporal=4,
    patch=(2, 2), frames_per_chunk=3, sink_frames=9, global_sink_frames=9, window_frames=18,
    height=480, width=832, fps=16, default_frames=117,
)
#: the rows: the name shown -> the planner's setting
ROWS = {"off": "off", "int4": "int4-default", "int2": "int2-default"}
#: chunks past the window the planned stream runs, so the steady state is reached
_EXTRA_CHUNKS = 4


@dataclass(frozen=True)
class SessionPlan:
    """One row: a request-mode session's self-attention bytes at one setting (all layers):
    causalkv's stores at most (``session_bytes``) and vLLM-Omni's dense cache (``dense_bytes``)."""

    setting: str
    session_bytes: int
    dense_bytes: int


def _check_rows(rows: Collection[str], known: Collection[str]) -> None:
    """`ConfigError` naming every one of ``rows`` not among ``known``, before any is planned."""
    unknown = [r for r in rows if r not in known]
    if unknown:
        raise ConfigError(f"vllm-omni rows must be among {list(known)}, got {unknown}")


def plan_sessions(*, geom: ModelGeometry = VLLM_OMNI_LINGBOT, rows: tuple[str, ...] = tuple(ROWS),
                  height: int | None = None, width: int | None = None) -> list[SessionPlan]:
    """Bytes per request-mode session for each of ``rows`` (`ROWS`)."""
    _check_rows(rows, ROWS)
    latent = geom.window_frames + _EXTRA_CHUNKS * geom.frames_per_chunk
    lay = stream_layout(geom, MemoryRequest(latent_frames=latent, height=height, width=width))
    out = []
    for row in rows:
        p = plan_setting(geom, lay, SETTINGS[ROWS[row]], cache=STREAM_CACHE,
                         attention="gathered", record=False)
        out.append(SessionPlan(row, p.kv_bytes + geom.num_layers * p.chunk_bytes, p.dense_bytes))
    return out


# ---------------------------------------------------------------------------------------------
# Admission on vLLM-Omni's paged AR-diffusion engine (realtime sessions)
# ---------------------------------------------------------------------------------------------
#: LingBot-World's text cross-attention cache: vLLM-Omni 0.30.0's ``_MAX_SEQUENCE_LENGTH``
LINGBOT_TEXT_TOKENS = 512
#: LingBot-World's condition: ``vae_scale_temporal + out_channels`` channels per latent pixel
_LINGBOT_CONDITION_CHANNELS = 4 + 16
#: the Wan 2.1 VAE's per-session state vLLM-Omni 0.30.0 declares, per output pixel: the
#: condition encoder's causal-convolution history (elements; two of them: committed and in
#: flight) and the streaming decoder's (bytes per pixel at float32, its measured constant
#: ``_STREAMING_DECODE_BYTES_PER_PIXEL_FP32`` = 37832 KiB / 64x64)
_WAN_ENCODER_ELEMENTS_PER_PIXEL = 1404
_WAN_DECODER_BYTES_PER_PIXEL_FP32 = 9458


def lingbot_model_state_bytes(height: int, width: int, *, num_layers: int = 40, num_heads: int = 40,
                              head_dim: int = 128, frames_per_block: int = 3, itemsize: int = 2) -> int:
    """``model_owned_state_bytes_per_session`` that vLLM-Omni 0.30.0's LingBot-World pipeline
    declares (``LingBotWorldCausalDMDPipeline.ar_diffusion_kv_cache_spec``, one Ulysses rank, the
    Wan 2.1 VAE, transformer and VAE of ``itemsize`` bytes per element): the image condition of
    one block, the camera modulation of one block in every layer, two condition-encoder
    histories and the streaming decoder's cache. The bridge suite checks it against the
    pipeline's own method (`causalkv.vllm_omni.paged_seams`, tests/vllm_omni_bridge)."""
    lh, lw = height // 8, width // 8
    tokens = (lh // 2) * (lw // 2)
    condition = _LINGBOT_CONDITION_CHANNELS * frames_per_block * lh * lw * itemsize
    camera = 2 * num_layers * frames_per_block * tokens * num_heads * head_dim * itemsize
    encoder = 2 * _WAN_ENCODER_ELEMENTS_PER_PIXEL * height * width * itemsize
    decoder = _WAN_DECODER_BYTES_PER_PIXEL_FP32 * height * width * itemsize // 4
    return condition + camera + encoder + decoder


@dataclass(frozen=True)
class EngineGeometry:
    """What vLLM-Omni's AR-diffusion engine admits sessions from: the pipeline's
    ``ARDiffusionKVCacheSpec`` and the runner's ``ARDiffusionKVConfig`` as
    ``ARDiffusionKVCache.__init__`` reads them (one paged block = one latent frame, all layers).

    Attributes:
        name: shown in the header.
        num_layers, num_kv_heads, head_size: the self-attention pool (``num_kv_heads``: the
            heads this rank holds).
        dtype: the pool's dtype (a key of `causalkv.config.DTYPE_BYTES`).
        tokens_per_frame: tokens per latent frame = the block size.
        frames_per_block: frames one tick generates (counted once: one request in flight).
        sink_frames, window_frames: the sink and the recent window (``spec.window_frames``);
            a forward reads at most ``sink_frames + window_frames`` frames, its own included.
        kv_branches, local_kv_branches: ``len(spec.kv_branches)`` and the branch slots this
            worker allocates (``num_local_kv_branches``).
        cross_attention: per cross-attention cache, ``(tokens, heads)``.
        model_state_bytes: ``model_owned_state_bytes_per_session``.
        scratch_blocks_per_branch: scratch blocks per branch slot (the engine's rule:
            ``frames_per_block`` plus the declared scratch tokens in blocks, or the
            ``AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH`` override when larger); 0: the rule
            without declared scratch.

    vLLM-Omni's history staging (``reuse_history_staging``) is not modelled: causalkv's paged
    cache refuses it (`causalkv.vllm_omni.paged_cache.check_kv_config`).
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    tokens_per_frame: int
    frames_per_block: int
    sink_frames: int
    window_frames: int
    kv_branches: int = 1
    local_kv_branches: int = 1
    cross_attention: tuple[tuple[int, int], ...] = ()
    model_state_bytes: int = 0
    scratch_blocks_per_branch: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"{self.name}: dtype must be one of {list(DTYPE_BYTES)}, got {self.dtype!r}")
        positive = ("num_layers", "num_kv_heads", "head_size", "tokens_per_frame",
                    "frames_per_block", "window_frames", "kv_branches", "local_kv_branches")
        for field in (*positive, "sink_frames", "model_state_bytes", "scratch_blocks_per_branch"):
            check_int(f"{self.name}: {field}", getattr(self, field), minimum=int(field in positive),
                      hint="fix the pipeline's ARDiffusionKVCacheSpec")
        for tokens, heads in self.cross_attention:
            check_int(f"{self.name}: cross-attention tokens", tokens, minimum=1, hint="fix the spec")
            check_int(f"{self.name}: cross-attention heads", heads, minimum=1, hint="fix the spec")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """One block (one latent frame) of K and V in every layer: the engine's
        ``spec.page_size_bytes * num_layers``."""
        return 2 * self.tokens_per_frame * self.num_kv_heads * self.head_size * self.itemsize * self.num_layers

    @property
    def scratch_bytes(self) -> int:
        """The scratch pool (outside the manager): ``local branches x scratch blocks``."""
        per_branch = self.scratch_blocks_per_branch or self.frames_per_block
        return self.local_kv_branches * per_branch * self.page_bytes

    @property
    def cross_bytes(self) -> int:
        """One session's cross-attention caches (every branch, every layer)."""
        return sum(2 * self.kv_branches * tokens * heads * self.head_size * self.itemsize * self.num_layers
                   for tokens, heads in self.cross_attention)



def lingbot_engine(height: int | None = None, width: int | None = None, *,
                   geom: ModelGeometry = VLLM_OMNI_LINGBOT, dtype: str = "bfloat16") -> EngineGeometry:
    """LingBot-World's `EngineGeometry` at ``height x width`` (default 480x832) as vLLM-Omni
    0.30.0's pipeline declares it for one Ulysses rank: 40 layers x 40 heads x 128, 3-frame
    blocks, sink 9, recent window 9 (18 frames read per forward), one branch, the 512-token
    text cache, `lingbot_model_state_bytes`."""
    height = geom.height if height is None else height
    width = geom.width if width is None else width
    tpf = geom.tokens_per_frame(height, width)
    return EngineGeometry(
        f"{geom.name} on the AR-diffusion engine", geom.num_layers, geom.num_heads, geom.head_dim,
        dtype, tpf, geom.frames_per_chunk, geom.sink_frames, geom.window_frames - geom.sink_frames,
        cross_attention=((LINGBOT_TEXT_TOKENS, geom.num_heads),),
        model_state_bytes=lingbot_model_state_bytes(
            height, width, num_layers=geom.num_layers, num_heads=geom.num_heads,
            head_dim=geom.head_dim, frames_per_block=geom.frames_per_chunk,
            itemsize=DTYPE_BYTES[dtype]),
    )


#: the cache causalkv's paged store is: `STREAM_CACHE`'s cursor (after each commit, what the next
#: forward reads), packing policy and centroid rule; `causalkv_layout` counts it and
#: `causalkv.vllm_omni.paged_cache` runs it
ENGINE_CACHE = STREAM_CACHE


@dataclass(frozen=True)
class SessionLayout:
    """What one resident session holds between ticks, per branch (all layers).

    Attributes:
        setting: the row's name.
        bf16_frames: paged blocks (latent frames) it holds in the pool, at most.
        packed_bytes: bytes of its packed groups (causalkv's store), at most.
        tiers: per tick, the tier of every group held after its commit (group -> ``"bf16"``
            or the codec's name), as the planner decided it (empty for the stock engine).
        per_tick: per tick, ``(bf16 frames, packed bytes)`` held after its commit (the most of
            each is ``bf16_frames`` and ``packed_bytes``; empty for the stock engine).
    """

    setting: str
    bf16_frames: int
    packed_bytes: int
    tiers: tuple[Mapping[int, str], ...] = ()
    per_tick: tuple[tuple[int, int], ...] = ()


def stock_layout(eng: EngineGeometry) -> SessionLayout:
    """vLLM-Omni's own pool: every session holds ``sink + window`` frames in bf16 pages, the
    oldest window group (read by no later forward) included."""
    return SessionLayout("stock", eng.sink_frames + eng.window_frames, 0)


def engine_stream(eng: EngineGeometry) -> tuple[ModelGeometry, StreamLayout]:
    """The planner's model of one session's stream on the engine: the cursor of causalkv's
    store (`STREAM_CACHE`: after each commit it holds what the next forward reads, never the
    group it will not) over ``sink + window`` frames, run ``_EXTRA_CHUNKS`` groups past the
    window (the steady state). `ConfigError` when the sink or the window is not a whole number
    of ticks (a group would straddle the window)."""
    fpb = eng.frames_per_block
    total = eng.sink_frames + eng.window_frames
    if eng.sink_frames % fpb or total % fpb or total < eng.sink_frames + fpb:
        raise ConfigError(
            f"{eng.name}: causalkv's paged store keeps whole {fpb}-frame ticks; sink_frames "
            f"{eng.sink_frames} and sink + window {total} must be multiples of {fpb}, with room "
            "for one tick beside the sink"
        )
    geom = ModelGeometry(eng.name, eng.num_layers, eng.num_kv_heads, eng.head_size,
                         vae_scale_spatial=1, vae_scale_temporal=1, patch=(1, 1),
                         frames_per_chunk=fpb, sink_frames=eng.sink_frames,
                         global_sink_frames=eng.sink_frames, window_frames=total,
                         height=eng.tokens_per_frame, width=1)
    return geom, stream_layout(geom, MemoryRequest(latent_frames=total + _EXTRA_CHUNKS * fpb, dtype=eng.dtype))


def causalkv_layout(eng: EngineGeometry, quant: QVGKVQuantArgs, setting: str = "") -> SessionLayout:
    """causalkv's pages: per tick, the groups the next forward reads (`engine_stream`) at the
    tiers `plan_setting` decides for ``quant`` (the packing policy, the store's tier policy,
    the codec's ``nbytes``): bf16 groups in the pool, the others packed. The most of each over
    the stream is what a session holds at most."""
    geom, lay = engine_stream(eng)
    p = plan_setting(geom, lay, Setting(setting or "paged", quant.codec), cache=ENGINE_CACHE,
                     dtype=eng.dtype, quant=quant, record=True)
    per_tick = []
    for resident, tiers in zip(p.resident_per_chunk, p.tiers_per_chunk):
        dense = sum(1 for t in tiers.values() if t == "bf16")
        per_tick.append((dense * eng.frames_per_block,
                         (resident - dense * p.chunk_bytes) * eng.num_layers))
    return SessionLayout(setting or (quant.codec or "off"), max(f for f, _ in per_tick),
                         max(b for _, b in per_tick), p.tiers_per_chunk, tuple(per_tick))


@dataclass(frozen=True)
class Admission:
    """The engine's admission at one memory budget (``ARDiffusionKVCache.__init__``'s rule).

    Attributes:
        layout: the session layout admitted.
        configured_budget_bytes: ``int(available_bytes * gpu_memory_fraction)`` (`admit`'s
            free device memory and fraction).
        memory_budget_bytes: that, raised to one session when one fits the free memory.
        session_bytes: one session's bytes: its pool blocks, packed groups, cross-attention
            caches and model-owned state (all branches).
        fixed_bytes: what does not grow with sessions: the scratch pool,
            the in-flight tick's blocks and the pool's two spare blocks.
        capacity: the sessions admitted: ``min(requested, (budget - fixed) // session)``
            (a session of 0 bytes: ``requested``).
        pool_blocks: the managed pool's blocks: what the budget leaves after scratch
            and the admitted sessions' cross-attention, model state and packed groups.
        requested_capacity: the pipeline's upper bound (None: none).
        page_bytes: one block in every layer (`EngineGeometry.page_bytes`).
    """

    layout: SessionLayout
    configured_budget_bytes: int
    memory_budget_bytes: int
    session_bytes: int
    fixed_bytes: int
    capacity: int
    pool_blocks: int
    requested_capacity: int | None
    page_bytes: int

    @property
    def pool_bytes_per_session(self) -> int:
        """The pool pages one session holds at most (bf16 frames x page)."""
        return self.layout.bf16_frames * self.page_bytes

    def as_json(self) -> dict[str, Any]:
        return {"setting": self.layout.setting, "bf16_frames": self.layout.bf16_frames,
                "pool_bytes_per_session": self.pool_bytes_per_session,
                "packed_bytes_per_session": self.layout.packed_bytes,
                "session_bytes": self.session_bytes, "fixed_bytes": self.fixed_bytes,
                "memory_budget_bytes": self.memory_budget_bytes, "sessions": self.capacity,
                "requested_capacity": self.requested_capacity, "pool_blocks": self.pool_blocks}


def _bytes(eng: EngineGeometry, layout: SessionLayout) -> tuple[int, int, int]:
    """``(fixed, beside the pool, session)`` bytes of the engine's rule for ``layout``: what does
    not grow with sessions (scratch, the in-flight tick's blocks and two spare
    blocks); per session what it holds outside the pool (cross-attention, model state, packed
    groups); per session in all (that plus its bf16 frames' pool pages)."""
    lb = eng.local_kv_branches
    fixed = eng.scratch_bytes + (lb * eng.frames_per_block + 2) * eng.page_bytes
    beside = eng.cross_bytes + eng.model_state_bytes + lb * layout.packed_bytes
    return fixed, beside, beside + lb * layout.bf16_frames * eng.page_bytes


def required_bytes(eng: EngineGeometry, layout: SessionLayout, sessions: int) -> int:
    """The engine's ``_required_bytes(sessions)`` for ``layout``: scratch +
    per session (cross-attention + model state + packed groups) + the managed blocks
    ``local_branches x (sessions x bf16_frames + frames_per_block) + 2``, each a page."""
    fixed, _, session = _bytes(eng, layout)
    return fixed + sessions * session


def admit(eng: EngineGeometry, layout: SessionLayout, *, available_bytes: int,
          gpu_memory_fraction: float = 0.1, requested_capacity: int | None = None) -> Admission:
    """The sessions vLLM-Omni's AR-diffusion engine admits at ``available_bytes`` of free
    device memory, and its pool: ``ARDiffusionKVCache.__init__``'s arithmetic (budget
    ``int(available x fraction)``, raised to one session when one fits; the largest count
    whose `required_bytes` fit; the pool gets what is left), with a session counted as
    ``layout`` holds it. For `stock_layout` this is the engine's own figure (the bridge suite
    checks it against ``ARDiffusionKVCache`` built without tensors); for `causalkv_layout`,
    causalkv's paged cache admits by it.

    Raises:
        ConfigError: a bad budget or fraction, one session does not fit the free memory
            (the engine refuses to start then), or a session of 0 bytes with no
            ``requested_capacity`` (the memory bounds no count).
    """
    check_int("available_bytes", available_bytes, minimum=0, hint="pass the free device memory")
    if not is_number(gpu_memory_fraction) or not 0.0 < gpu_memory_fraction <= 1.0:
        raise ConfigError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction!r}")
    if requested_capacity is not None:
        check_int("session_capacity", requested_capacity, minimum=1, hint="pass 1 or more")
    fixed, beside, session = _bytes(eng, layout)
    one = fixed + session
    if one > available_bytes:
        raise ConfigError(
            f"{eng.name} ({layout.setting}): one session needs {one:,} bytes ({format_bytes(one)}: "
            f"scratch, the in-flight tick, its pages, packed groups, cross-attention and model "
            f"state), the free memory is {available_bytes:,} ({format_bytes(available_bytes)}); "
            "free device memory or lower the resolution"
        )
    configured = int(available_bytes * gpu_memory_fraction)
    budget = max(configured, one)
    if session == 0 and requested_capacity is None:  # the engine always passes its cap
        raise ConfigError(
            f"{eng.name} ({layout.setting}): a session holds no bytes between ticks (no sink, a "
            "window of one tick, no cross-attention or model state), so the memory bounds no "
            "session count; pass session_capacity"
        )
    # as the engine's search: the most sessions whose bytes fit, at most the cap
    capacity = (budget - fixed) // session if session else requested_capacity
    if requested_capacity is not None:
        capacity = min(capacity, requested_capacity)
    pool = (budget - eng.scratch_bytes - capacity * beside) // eng.page_bytes
    return Admission(layout, configured, budget, session, fixed, capacity, pool, requested_capacity,
                     eng.page_bytes)


#: LingBot-World's pipeline declares ``session_capacity=2`` (vLLM-Omni 0.30.0)
LINGBOT_STOCK_CAPACITY = 2
#: the rows of the admission table: vLLM-Omni's own pool, then causalkv's pages per setting
ADMISSION_ROWS = ("stock", *ROWS)


def plan_admission(budget: int | None, *, rows: tuple[str, ...] = ADMISSION_ROWS,
                   height: int | None = None, width: int | None = None,
                   eng: EngineGeometry | None = None) -> list[Admission]:
    """Sessions vLLM-Omni's AR-diffusion engine admits with a memory budget of ``budget`` bytes
    (its ``free memory x gpu_memory_fraction``), per row: ``stock`` (vLLM-Omni's pool, LingBot's
    declared cap of 2) and causalkv's pages at each setting (no cap: the pipeline declares what
    fits). ``eng``: the engine geometry (default LingBot-World's at ``height x width``).
    ``budget`` None: the bytes only (each row admitted at the memory of one session)."""
    check_budget(budget)
    eng = lingbot_engine(height, width) if eng is None else eng
    _check_rows(rows, ADMISSION_ROWS)
    out = []
    for row in rows:
        layout = stock_layout(eng) if row == "stock" else causalkv_layout(
            eng, SETTINGS[ROWS[row]].quant_args(), row)
        available = required_bytes(eng, layout, 1) if budget is None else budget
        out.append(admit(eng, layout, available_bytes=available, gpu_memory_fraction=1.0,
                         requested_capacity=LINGBOT_STOCK_CAPACITY if row == "stock" else None))
    return out


def format_admission(eng: EngineGeometry, admissions: list[Admission], budget: int | None) -> str:
    """The admission table ``causalkv memory lingbot --host vllm-omni [--budget B]`` prints
    (the sessions column with a budget only)."""
    if not admissions:
        return ""
    first = admissions[0]
    lines = [
        f"{eng.name}: {eng.num_layers} layers x {eng.num_kv_heads} heads x {eng.head_size}, "
        f"{eng.tokens_per_frame:,} tokens per latent frame (one paged block, "
        f"{format_bytes(eng.page_bytes)} in all layers), {eng.frames_per_block}-frame ticks, sink "
        f"{eng.sink_frames} + window {eng.window_frames} frames"
        + ("" if budget is None else f"; memory budget {format_bytes(first.memory_budget_bytes)} "
           "(free memory x gpu_memory_fraction)"),
        f"{'setting':8s} {'pool/session':>13s} {'packed/session':>15s} {'session_bytes':>14s}"
        + ("" if budget is None else f" {'sessions':>9s}"),
    ]
    for a in admissions:
        lines.append(
            f"{a.layout.setting:8s} {format_bytes(a.pool_bytes_per_session):>13s} "
            f"{format_bytes(a.layout.packed_bytes):>15s} {format_bytes(a.session_bytes):>14s}"
            + ("" if budget is None else f" {a.capacity:>9d}"))
    lines += [
        f"session_bytes: the session's pool pages (stock: sink + window frames; causalkv: the bf16 "
        f"groups the next tick reads) + its packed groups + text cross-attention "
        f"{format_bytes(eng.cross_bytes)} + model-owned state {format_bytes(eng.model_state_bytes)}",
        f"sessions = min(cap, (budget - {format_bytes(first.fixed_bytes)}) // session_bytes): the "
        f"fixed part is the scratch pool, the in-flight tick and two spare blocks; stock's cap is "
        f"LingBot's declared {LINGBOT_STOCK_CAPACITY}, causalkv's pipeline declares what fits",
    ]
    return "\n".join(lines)
