"""Every piece of vLLM-Omni's experimental AR-diffusion package causalkv's paged path relies on.

vLLM-Omni's realtime engine (``vllm_omni.experimental.ar_diffusion``) is experimental: its
classes, fields and module globals can change in any release. causalkv's paged path
(`causalkv.vllm_omni.paged_cache`, `causalkv.vllm_omni.paged_pipeline`) uses the names listed
here and nothing else of that package, each read from vLLM-Omni `READ_FROM` (with vLLM
`VLLM_READ_FROM`, whose paged-KV manager the engine drives). `check_seams` runs before the paged
path is installed and refuses, in one line naming the missing seam and both versions, a
vLLM-Omni that lacks one; `missing_seams` lists them all.

Kinds of seam (`Seam.kind`):

- ``attribute``: a module-level name, class, function or class attribute (a dotted path
  inside ``module``);
- ``parameter``: keyword parameters a callable takes (``names``);
- ``field``: fields of a dataclass / NamedTuple (``names``);
- ``instance``: attributes an ``ARDiffusionKVCache`` built without tensors carries (``names``);
  checked by building one at a tiny geometry (no tensors are allocated).

Importing this module imports neither vLLM nor vLLM-Omni (`check_seams` does).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from causalkv.errors import ConfigError

__all__ = [
    "READ_FROM",
    "SEAMS",
    "VLLM_READ_FROM",
    "Seam",
    "check_seams",
    "installed_versions",
    "missing_seams",
]

#: the vLLM-Omni release the seams were read from
READ_FROM = "0.30.0"
#: the vLLM release installed beside it (its ``KVCacheManager`` / ``BlockPool``)
VLLM_READ_FROM = "0.30.0"

_AR = "vllm_omni.experimental.ar_diffusion"
_LINGBOT = "vllm_omni.diffusion.models.lingbot_world"
_KV_INIT = (
    "config", "num_layers", "num_kv_heads", "head_size", "dtype", "block_size", "max_model_len",
    "available_bytes", "kv_branches", "session_capacity", "cross_attention_lengths",
    "cross_attention_kv_heads", "device", "frames_per_block", "max_scratch_tokens_per_branch",
    "model_owned_state_bytes_per_session",
)


@dataclass(frozen=True)
class Seam:
    """One thing causalkv's paged path uses of vLLM-Omni (or vLLM).

    Attributes:
        module: the module holding it.
        path: a dotted path inside ``module`` (a name, ``Class.method``).
        kind: ``attribute``, ``parameter``, ``field`` or ``instance`` (the module docstring).
        why: what causalkv does with it (shown in a refusal).
        names: the parameters, fields or instance attributes relied on (``parameter``,
            ``field``, ``instance``).
    """

    module: str
    path: str
    kind: str
    why: str
    names: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.module}.{self.path}"


#: the seams, in the order causalkv meets them
SEAMS: tuple[Seam, ...] = (
    Seam(f"{_AR}.engine", "ARDiffusionEngine", "attribute",
         "the engine a stage names in engine_backend; its workers build the runner below"),
    Seam(f"{_AR}.runner", "ARDiffusionModelRunner._preallocate_kv_cache", "attribute",
         "builds the session cache from the pipeline's spec"),
    Seam(f"{_AR}.runner", "ARDiffusionKVCache", "attribute",
         "the name _preallocate_kv_cache constructs: causalkv's cache is built in its place"),
    Seam(f"{_AR}.runner", "resolve_ar_diffusion_kv_config", "attribute",
         "the runner's ARDiffusionKVConfig from the stage config (gpu_memory_fraction)"),
    Seam(f"{_AR}.kv_cache.config", "ARDiffusionKVConfig", "field",
         "the admission inputs", ("enable", "chunk_size", "window_chunks", "sink_chunks",
                                  "gpu_memory_fraction", "reuse_history_staging")),
    Seam(f"{_AR}.capability", "ARDiffusionKVCacheSpec", "field",
         "the pipeline's declared geometry and session policy",
         ("num_layers", "num_kv_heads", "head_size", "tokens_per_frame", "frames_per_block",
          "window_frames", "kv_branches", "session_capacity", "sink_frames", "cross_attention",
          "max_scratch_tokens_per_branch", "model_owned_state_bytes_per_session")),
    Seam(f"{_AR}.capability", "ARDiffusionKVBranchSpec", "field",
         "the spec's KV branches", ("name", "local_index")),
    Seam(f"{_AR}.kv_cache.manager", "ARDiffusionKVCache.__init__", "parameter",
         "causalkv's cache subclasses it and runs its validation", _KV_INIT),
    Seam(f"{_AR}.kv_cache.manager", "ARDiffusionKVCache", "instance",
         "the pool, manager and budget causalkv re-admits",
         ("spec", "manager", "managed_num_blocks", "num_blocks", "num_blocks_total", "null_block_id",
          "scratch_reserved_bytes", "scratch_num_blocks", "cross_attention_bytes_per_session",
          "session_capacity", "memory_budget_bytes", "configured_memory_budget_bytes",
          "available_memory_bytes", "cross_attention_reserved_bytes",
          "model_owned_state_reserved_bytes", "_kv_pools",
          "_k_pools", "_v_pools", "_allocate_tensors", "device", "num_local_kv_branches",
          "block_size", "num_layers", "num_kv_heads", "head_size", "dtype")),
    *(Seam(f"{_AR}.kv_cache.manager", f"ARDiffusionKVCache.{name}", "attribute", why)
      for name, why in (
          ("begin_request", "a session's branch opens"),
          ("end_request", "a session closes, is evicted or fails: its packed groups are dropped"),
          ("allocate_token_slots", "the committing forward's pages (its logical frames noted)"),
          ("block_table", "the session's compact table of pool pages"),
          ("commit_chunk", "a committed frame: at a tick's end causalkv packs and frees pages"),
          ("window_block_ids", "the resident pages"),
          ("key_cache", "a layer's K pool as [blocks, block_size, H, D]"),
          ("value_cache", "a layer's V pool"),
      )),
    Seam(f"{_AR}.kv_cache.manager", "build_kv_manager", "parameter",
         "the managed pool at causalkv's block count", ("spec", "layer_names", "num_blocks",
                                                        "max_model_len")),
    Seam(f"{_AR}.kv_cache.paged", "allocate_kv_pool_with_views", "attribute",
         "the per-layer K/V pools at causalkv's block count"),
    Seam(f"{_AR}.kv_cache.paged_attention", "ar_diffusion_paged_attention", "parameter",
         "attention over pool pages and decoded packed groups (the engine's own kernel)",
         ("block_table", "query_start_loc", "seq_lens", "max_query_len", "max_seq_len",
          "softmax_scale")),
    Seam(f"{_AR}.kv_cache.paged_attention", "ARDiffusionPagedLayerInputs", "field",
         "one layer's forward inputs (pools, slots, block table)",
         ("layer_idx", "key_pool", "value_pool", "block_size", "video_slots", "block_table",
          "query_start_loc", "seq_lens", "max_query_len", "max_seq_len")),
    Seam(f"{_AR}.tick_protocol", "ARDiffusionTickRequest.from_extra_args", "attribute",
         "a tick's session id and chunk index (the eviction notice)"),
    Seam(f"{_LINGBOT}.transformer", "paged_write_attn", "attribute",
         "LingBot's self-attention calls this module global; causalkv's serves its own pools"),
    *(Seam(f"{_LINGBOT}.pipeline", f"LingBotWorldCausalDMDPipeline.{name}", "attribute", why)
      for name, why in (
          ("ar_diffusion_kv_cache_spec", "the spec causalkv declares its capacity on"),
          ("bind_ar_diffusion_state", "the session a forward runs for"),
          ("close_ar_diffusion_session", "a session's release (close, eviction, failure)"),
          ("reset_ar_diffusion_session", "a session's reset"),
      )),
    Seam("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager._remove_blocks_in_range",
         "attribute", "a packed or unread page goes back to the pool (vLLM's own release)"),
)


def installed_versions() -> tuple[str | None, str | None]:
    """``(vllm-omni, vllm)`` as installed (None where a distribution is absent)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(dist: str) -> str | None:
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    return installed("vllm-omni"), installed("vllm")


def _probe_cache() -> Any:
    """An ``ARDiffusionKVCache`` at a tiny geometry, built without tensors (``device=None``)."""
    import torch
    from vllm_omni.experimental.ar_diffusion.capability import ARDiffusionKVBranchSpec
    from vllm_omni.experimental.ar_diffusion.kv_cache.config import ARDiffusionKVConfig
    from vllm_omni.experimental.ar_diffusion.kv_cache.manager import ARDiffusionKVCache

    config = ARDiffusionKVConfig(enable=True, chunk_size=4, window_chunks=2, sink_chunks=1,
                                 gpu_memory_fraction=1.0)
    return ARDiffusionKVCache(
        config, num_layers=1, num_kv_heads=1, head_size=8, dtype=torch.float32, block_size=4,
        max_model_len=64, available_bytes=1 << 20, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
        session_capacity=1, device=None, frames_per_block=1)


#: a seam's refusal when some of its ``names`` are absent, by kind
_ABSENT = {"parameter": "no parameter(s) {}", "field": "no field(s) {}",
           "instance": "no attribute(s) {} on an instance"}


def _problem(seam: Seam, probe: Callable[[], Any]) -> str | None:
    try:
        obj = functools.reduce(getattr, seam.path.split("."), importlib.import_module(seam.module))
    except ImportError as exc:
        return f"cannot import {seam.module} ({exc})"
    except AttributeError:
        return "no such name"
    if seam.kind == "attribute":
        return None
    if seam.kind == "parameter":
        try:
            have = set(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            return "not a callable with a signature"
    elif seam.kind == "field":
        have = ({f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj)
                else set(getattr(obj, "_fields", ())))
    elif seam.kind == "instance":
        try:
            inst = probe()
        except Exception as exc:  # noqa: BLE001 - any failure to build is the seam's problem
            return f"cannot be built without tensors ({type(exc).__name__}: {exc})"
        have = {n for n in seam.names if hasattr(inst, n)}
    else:
        raise ConfigError(f"seam {seam.where}: unknown kind {seam.kind!r}")
    absent = [n for n in seam.names if n not in have]
    return _ABSENT[seam.kind].format(absent) if absent else None


def missing_seams(seams: tuple[Seam, ...] = SEAMS,
                  probe: Callable[[], Any] = _probe_cache) -> list[tuple[Seam, str]]:
    """The seams the installed vLLM-Omni (and vLLM) lack, each with what is wrong (empty when
    every seam is there). Imports vLLM-Omni."""
    return [(seam, problem) for seam in seams if (problem := _problem(seam, probe)) is not None]


def check_seams(seams: tuple[Seam, ...] = SEAMS, probe: Callable[[], Any] = _probe_cache) -> None:
    """Refuse a vLLM-Omni that lacks a seam of causalkv's paged path.

    Raises:
        ConfigError: one line naming the first missing seam, what causalkv uses it for, the
            version it was read from and the installed one, and the fix.
    """
    missing = missing_seams(seams, probe)
    if not missing:
        return
    seam, problem = missing[0]
    omni, vllm = installed_versions()
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise ConfigError(
        f"causalkv's paged path needs {seam.where} ({seam.kind}: {problem}; used for: {seam.why}), "
        f"read from vLLM-Omni {READ_FROM} with vLLM {VLLM_READ_FROM}; the installed vLLM-Omni "
        f"{omni or 'none'} with vLLM {vllm or 'none'} lacks it{more}: install "
        f"vllm-omni=={READ_FROM} vllm=={VLLM_READ_FROM}, or run QVG in request mode "
        "(engine_backend 'default')"
    )
