"""CPU stand-in: a vLLM-Omni platform for a CPU (picked through `vo_cpu_platform.activate`).

vLLM-Omni 0.30.0 ships platforms for cuda, rocm, npu, xpu and musa only; on a CPU it falls back
to ``UnspecifiedOmniPlatform``, which has no attention backend and no device. This one: device
``cpu`` (one), ``gloo`` for torch.distributed, vLLM-Omni's own torch SDPA attention backend;
for the offline entry point's diffusion runner also no torch.compile (``supports_torch_inductor``
is abstract in the base) and no-op allocator statistics (``reset_peak_memory_stats``,
``empty_cache``, ``max_memory_reserved``/``_allocated``: the base forwards them to ``torch.cpu``,
which has none, and the runner calls the None it gets); for the AR-diffusion engine's runner the
free memory its admission sizes the session pool by (``get_free_memory``: the base raises).
Not part of the causalkv distribution.
"""

from __future__ import annotations

import os

import torch
from vllm_omni.platforms.interface import OmniPlatformEnum, UnspecifiedOmniPlatform


class CPUOmniPlatform(UnspecifiedOmniPlatform):
    _omni_enum = OmniPlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend: str | None, head_size: int,
                                       allow_trtllm_default: bool = False) -> str:
        return "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"

    @classmethod
    def supports_float64(cls) -> bool:
        return True

    @classmethod
    def supports_torch_inductor(cls) -> bool:  # the diffusion runner asks before compiling
        return False

    # the diffusion runner's per-request memory statistics (torch has no CPU allocator stats)
    @classmethod
    def reset_peak_memory_stats(cls, device: torch.device | None = None) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def max_memory_reserved(cls, device: torch.device | None = None) -> int:
        return 0

    @classmethod
    def max_memory_allocated(cls, device: torch.device | None = None) -> int:
        return 0

    # the AR-diffusion engine's admission (ARDiffusionModelRunner._available_memory_bytes)
    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        """``CAUSALKV_CPU_FREE_MEMORY`` bytes when set (the tests and the demo pin it, so the
        sessions admitted do not depend on the machine), else the RAM available now."""
        pinned = os.environ.get("CAUSALKV_CPU_FREE_MEMORY")
        if pinned:
            return int(pinned)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
