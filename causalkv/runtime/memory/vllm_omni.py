"""The planner for vLLM-Omni's LingBot-World: bytes per realtime session, sessions per budget.

vLLM-Omni 0.30.0's LingBot-World (``CausalLingBotWorldTransformer3DModel``'s checkpoint contract:
40 layers x 40 heads x 128, 3 latent frames per block, sink 9 frames, window 18 frames; 480x832
by default, 1,560 tokens per latent frame) keeps per layer ``[B, max_tokens, H, D]`` K and V,
``max_tokens`` = 18 x 1,560 = 28,080 (``allocate_lingbot_cache``). There is no CFG set.

With causalkv's store (`causalkv.vllm_omni.lingbot_cache.LingBotLayerKV`) each layer holds a
`QVGPackedCausalKVCache` whose context writes are unmarked (vLLM-Omni's ``update_cache=True``;
its DMD probes store nothing): the context at its tiers (the packing policy ``RECENT_CHUNKS``,
the codec's stored-bytes formula) and, in every layer, the chunk written last in bf16 (the
cache's current chunk until the next block advances). The context is what `plan_setting`
counts for that cache (`STREAM_CACHE`: after a commit, trimmed to what the next advance
keeps); so this module adds no rule of its own:

- ``session_bytes``: the most one session's stores hold (all layers): ``plan.kv_bytes`` (the
  context) ``+ layers x plan.chunk_bytes`` (each layer's current chunk, bf16); quantization
  off: vLLM-Omni's dense bytes exactly;
- ``transient_bytes``: one layer's visible K/V built for one attention call (vLLM-Omni's dense
  path builds the same ``torch.cat``), gathered: ``plan.transient_bytes``;
- ``dense_bytes``: vLLM-Omni's dense cache, allocated whole per request;
- ``sessions``: realtime sessions whose stores fit ``budget`` together with one call's
  transient (one device runs one forward at a time): ``(budget - transient) // session``.

Rows: ``off`` (causalkv's store, every chunk bf16), ``int4`` and ``int2`` (keep-recent 1, sink
packed: the settings' defaults). Out of scope, as for the other hosts: the text cross-attention
cache, vLLM-Omni's per-session model state (camera modulation, condition encoder), weights and
activations; the budget is the memory given to self-attention K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from causalkv.errors import ConfigError
from causalkv.runtime.memory.cache_models import STREAM_CACHE
from causalkv.runtime.memory.geometry import ModelGeometry
from causalkv.runtime.memory.layout import stream_layout
from causalkv.runtime.memory.plan import plan_setting
from causalkv.runtime.memory.records import SETTINGS, MemoryRequest, format_bytes

__all__ = ["ROWS", "VLLM_OMNI_LINGBOT", "SessionPlan", "format_sessions", "plan_sessions"]

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
    """One row: a realtime session's self-attention bytes at one setting (all layers)."""

    setting: str
    session_bytes: int
    transient_bytes: int
    dense_bytes: int
    sessions: int | None
    dense_sessions: int | None

    @property
    def ratio(self) -> float:
        return self.dense_bytes / self.session_bytes

    def as_json(self) -> dict[str, Any]:
        return {"setting": self.setting, "session_bytes": self.session_bytes,
                "transient_bytes": self.transient_bytes, "dense_bytes": self.dense_bytes,
                "dense_over_session": round(self.ratio, 4), "sessions": self.sessions,
                "dense_sessions": self.dense_sessions}


def plan_sessions(budget: int | None = None, *, geom: ModelGeometry = VLLM_OMNI_LINGBOT,
                  rows: tuple[str, ...] = tuple(ROWS), height: int | None = None,
                  width: int | None = None) -> list[SessionPlan]:
    """Bytes per session for each of ``rows`` (`ROWS`) and, with ``budget``, sessions that fit."""
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ConfigError(f"vllm-omni rows must be among {list(ROWS)}, got {unknown}")
    latent = geom.window_frames + _EXTRA_CHUNKS * geom.frames_per_chunk
    lay = stream_layout(geom, MemoryRequest(latent_frames=latent, height=height, width=width))
    out = []
    for row in rows:
        p = plan_setting(geom, lay, SETTINGS[ROWS[row]], cache=STREAM_CACHE,
                         attention="gathered", record=False)
        session = p.kv_bytes + geom.num_layers * p.chunk_bytes
        sessions = dense_sessions = None
        if budget is not None:
            sessions = max(0, (budget - p.transient_bytes) // session)
            dense_sessions = max(0, (budget - p.transient_bytes) // p.dense_bytes)
        out.append(SessionPlan(row, session, p.transient_bytes, p.dense_bytes, sessions, dense_sessions))
    return out


def format_sessions(plans: list[SessionPlan], budget: int | None,
                    geom: ModelGeometry = VLLM_OMNI_LINGBOT) -> str:
    """The table ``causalkv memory lingbot --host vllm-omni`` prints."""
    tpf = (geom.height // geom.vae_scale_spatial // geom.patch[0]) * (
        geom.width // geom.vae_scale_spatial // geom.patch[1])
    lines = [
        f"{geom.describe()}, host vllm-omni: {geom.height}x{geom.width} = {tpf:,} tokens per "
        f"latent frame, {geom.frames_per_chunk}-frame blocks, sink {geom.sink_frames}, window "
        f"{geom.window_frames} frames (max_tokens {geom.window_frames * tpf:,}); per realtime "
        "session, all layers, bf16",
        f"{'setting':8s} {'session_bytes':>16s} {'dense_bytes':>16s} {'dense/session':>13s}"
        + (f" {'sessions':>9s}" if budget is not None else ""),
    ]
    for p in plans:
        lines.append(
            f"{p.setting:8s} {format_bytes(p.session_bytes):>16s} {format_bytes(p.dense_bytes):>16s} "
            f"{p.ratio:>13.2f}" + (f" {p.sessions:>9d}" if budget is not None else ""))
    if budget is not None and plans:
        lines.append(
            f"budget {format_bytes(budget)}: sessions = (budget - one layer's visible K/V, "
            f"{format_bytes(plans[0].transient_bytes)}) // session_bytes; vLLM-Omni's dense "
            f"cache fits {plans[0].dense_sessions}")
    lines.append("session_bytes: the most one session's causalkv stores hold (40 layers); "
                 "dense_bytes: vLLM-Omni's [B, max_tokens, H, D] K and V per layer")
    return "\n".join(lines)
