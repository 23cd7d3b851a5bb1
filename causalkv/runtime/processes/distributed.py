"""Sequence parallelism over torch.distributed (Ulysses): process group, head slices, all-to-all.

One request runs on ``N`` processes (ranks), launched by torchrun (``causalkv generate
--nproc-per-node N`` re-executes itself under ``python -m torch.distributed.run``). Every rank
holds the whole transformer; a chunk's ``S`` tokens are split into ``N`` contiguous slices of
``S / N`` tokens by diffusers' context-parallel hooks (``WanTransformer3DModel._cp_plan``: split
at ``blocks.0``, gather at ``proj_out``). Each self-attention layer then exchanges

- ``[B, S/N, H, D]`` (this rank's tokens, every head) -> ``[B, S, H/N, D]`` (every token, this
  rank's heads ``[rank * H/N, (rank + 1) * H/N)``) before it writes and reads the rank's KV
  cache (`seq_to_heads`), and
- the inverse after attention (`heads_to_seq`),

each one ``all_to_all_single``. So each rank's causal caches hold ``H / N`` heads of every
retained token: KV memory per rank is ``1 / N`` of one process's. Cross-attention needs no
exchange (every rank has all heads of its own tokens and the whole text).

Backend by device: gloo on CPU, nccl on CUDA (one device per local rank). Collectives time out
after `DEFAULT_TIMEOUT_S` seconds, so a rank that dies cannot leave the others hanging.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from causalkv.errors import ConfigError
from causalkv.runtime.processes.launch import env_world, launched_by_torchrun

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "EXCHANGE",
    "ExchangeCounter",
    "ParallelContext",
    "backend_for",
    "check_parallel_request",
    "current",
    "enable_sequence_parallel",
    "exchange_nbytes",
    "gather_ints",
    "heads_to_seq",
    "init_parallel",
    "is_main_rank",
    "join_ranks",
    "local_main_first",
    "seq_to_heads",
    "shutdown",
]

T = TypeVar("T")

#: seconds a collective waits for the other ranks before it fails (gloo and nccl)
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the job.

    Attributes:
        rank, world_size: global rank and number of ranks (the default process group's).
        local_rank: on this node (the CUDA device index).
        device: this rank's torch device (``cpu`` or ``cuda:<local_rank>``).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, writes the video and the metrics."""
        return self.rank == 0

    def head_slice(self, num_heads: int) -> tuple[int, int]:
        """Global heads ``[start, stop)`` this rank attends over and caches."""
        if num_heads % self.world_size:
            raise ConfigError(
                f"{self.world_size} ranks cannot share {num_heads} attention heads; "
                f"pass --nproc-per-node among the divisors of {num_heads}"
            )
        h = num_heads // self.world_size
        return self.rank * h, (self.rank + 1) * h


_CURRENT: ParallelContext | None = None


@dataclass
class ExchangeCounter:
    """Bytes this rank sent to other ranks through `seq_to_heads` / `heads_to_seq`
    (``(N - 1) / N`` of each send buffer; the rest stays on the rank)."""

    bytes_sent: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0


#: the process-wide counter (benchmarks/parallel.py reads it per chunk)
EXCHANGE = ExchangeCounter()


def current() -> ParallelContext | None:
    """The context `init_parallel` set up in this process (None: one process)."""
    return _CURRENT


def is_main_rank() -> bool:
    """True on one process, and on rank 0 of a sequence-parallel job (it alone logs and writes)."""
    ctx = current()
    return ctx is None or ctx.is_main


def join_ranks(heads_sharded: int, device: str) -> ParallelContext | None:
    """The `ParallelContext` of a request of ``heads_sharded`` ranks (joins torchrun's process
    group on first use), None on one process. `ConfigError` when the ranks do not match."""
    if heads_sharded <= 1:
        return None
    ctx = init_parallel(device) if launched_by_torchrun() else current()  # joins on first use
    if ctx is None or ctx.world_size != heads_sharded:
        have = 1 if ctx is None else ctx.world_size
        raise ConfigError(
            f"heads_sharded={heads_sharded} needs as many torchrun ranks, this job has {have}; "
            f"run `causalkv generate --nproc-per-node {heads_sharded} ...` or torchrun"
        )
    return ctx


def backend_for(device: str | torch.device) -> str:
    """gloo for CPU, nccl for CUDA; `ConfigError` for any other device type."""
    backend = {"cpu": "gloo", "cuda": "nccl"}.get(torch.device(device).type)
    if backend is None:
        raise ConfigError(
            "sequence parallelism runs on cpu (gloo) or cuda (nccl), not on device "
            f"{str(device)!r}; pass --device cpu or --device cuda"
        )
    return backend


def cuda_problem(index: int = 0) -> str | None:
    """Why CUDA device ``index`` cannot run here (no CUDA build, no device, too few), or None."""
    if torch.version.cuda is None and torch.version.hip is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def check_devices(device: str | torch.device, local_ranks: int) -> None:
    """`ConfigError` when ``local_ranks`` processes on one node need more CUDA devices than it has."""
    if torch.device(device).type != "cuda" or local_ranks <= 1:
        return
    if (reason := cuda_problem()) is not None:
        raise ConfigError(
            f"--device {device}: {reason}; run the {local_ranks} processes on CPU with --device cpu (gloo)"
        )
    if (have := torch.cuda.device_count()) < local_ranks:
        raise ConfigError(
            f"--nproc-per-node {local_ranks} needs {local_ranks} CUDA devices, this machine has "
            f"{have}; pass --nproc-per-node {have} or fewer (or run on CPU with --device cpu)"
        )


def check_parallel_request(
    world_size: int, *, num_heads: int, tokens_per_chunk: int, device: str | torch.device
) -> None:
    """Refuse a sequence-parallel request that cannot run, before any weights load.

    Raises `ConfigError` when ``world_size`` does not divide the head count (each rank caches
    ``H / N`` heads) or the chunk's tokens (each rank takes ``S / N`` of them; nothing is
    padded), when the device has no backend, or when the processes of this node (torchrun's
    ``LOCAL_WORLD_SIZE`` in a worker, else ``world_size``: one node) need more CUDA devices
    than there are.
    """
    if world_size <= 1:
        return
    if num_heads % world_size:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ConfigError(
            f"--nproc-per-node {world_size} does not divide the model's {num_heads} attention "
            f"heads (each rank caches heads/N); pass one of {divisors}"
        )
    if tokens_per_chunk % world_size:
        raise ConfigError(
            f"--nproc-per-node {world_size} does not divide the chunk's {tokens_per_chunk} tokens "
            f"(each rank takes tokens/N of the sequence; no padding is done); pass a divisor of "
            f"{tokens_per_chunk}"
        )
    backend_for(device)
    check_devices(device, env_world()[3] if launched_by_torchrun() else world_size)


def init_parallel(device: str | torch.device = "cpu", *, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Join torchrun's process group (env:// rendezvous) with the backend of ``device``.

    Returns this rank's `ParallelContext` (also kept for `current`); CUDA ranks use device
    ``cuda:<local_rank>``. Collectives fail after ``timeout_s`` seconds. Idempotent.
    """
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    rank, world, local_rank, local_world = env_world()
    backend = backend_for(device)
    dev = torch.device("cpu")
    if backend == "nccl":
        check_devices(device, local_world)
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if backend == "nccl" else None)
    _CURRENT = ParallelContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                               local_rank=local_rank, device=dev)
    return _CURRENT


def shutdown() -> None:
    """Leave the process group (after the last collective)."""
    global _CURRENT
    if dist.is_initialized():
        dist.destroy_process_group()
    _CURRENT = None


# ---- the Ulysses exchange ----------------------------------------------------------------------
def _all_to_all(send: torch.Tensor, n: int) -> torch.Tensor:
    """``send`` ``[N, ...]`` exchanged (row i goes to rank i, row i of the result came from it),
    counted in `EXCHANGE`."""
    send = send.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    EXCHANGE.bytes_sent += send.numel() * send.element_size() * (n - 1) // n
    return recv


def seq_to_heads(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """``[B, S/N, H, D]`` (this rank's tokens) -> ``[B, S, H/N, D]`` (this rank's heads).

    Tokens come back in rank order, so the sequence is the contiguous split's concatenation.
    One ``all_to_all_single`` of ``B * S/N * H * D`` elements.
    """
    n = ctx.world_size
    b, s, h, d = x.shape
    recv = _all_to_all(x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4), n)
    # recv[i] = rank i's tokens of our heads
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def heads_to_seq(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The inverse of `seq_to_heads`: ``[B, S, H/N, D]`` -> ``[B, S/N, H, D]``."""
    n = ctx.world_size
    b, s_full, h, d = x.shape
    recv = _all_to_all(x.reshape(b, n, s_full // n, h, d).permute(1, 0, 2, 3, 4), n)
    # recv[i] = our tokens of rank i's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s_full // n, n * h, d)


def local_main_first(fn: Callable[[], T]) -> T:
    """``fn()`` on each node's local rank 0 first, then on the other ranks (after a barrier),
    so files ``fn`` creates (a preset folder) are written once; plain ``fn()`` on one process."""
    ctx = current()
    if ctx is None or ctx.world_size <= 1:
        return fn()
    result = fn() if ctx.local_rank == 0 else None
    dist.barrier()
    return fn() if ctx.local_rank != 0 else result  # type: ignore[return-value]


def gather_ints(value: int, ctx: ParallelContext) -> list[int]:
    """Every rank's ``value``, in rank order (every rank must call it)."""
    out = [0] * ctx.world_size
    dist.all_gather_object(out, int(value))
    return out


def exchange_nbytes(tokens: int, num_heads: int, head_dim: int, element_size: int, world_size: int,
                    *, layers: int, calls: int) -> int:
    """Bytes one rank sends through the all-to-alls of ``calls`` transformer calls.

    Per layer and call: q, k, v out (``3 * S/N * H * D`` elements) and the attention output
    back (``S/N * H * D``), of which ``(N - 1) / N`` leave the rank.
    """
    if world_size <= 1:
        return 0
    per_rank = tokens // world_size * num_heads * head_dim * element_size
    return 4 * per_rank * (world_size - 1) // world_size * layers * calls


def enable_sequence_parallel(transformer: torch.nn.Module, ctx: ParallelContext) -> None:
    """Split the transformer's sequence across ranks with diffusers' context-parallel hooks.

    Applies the model's ``_cp_plan`` (``WanTransformer3DModel``: split ``blocks.0``'s hidden
    states on the sequence, gather ``proj_out``'s output) through
    ``diffusers.hooks.context_parallel.apply_context_parallel`` with a ``ContextParallelConfig(
    ulysses_degree=N)`` whose mesh spans every rank. ``ModelMixin.enable_parallelism`` is not
    called: it derives the device as ``rank % torch.accelerator.device_count()``, a division by
    zero on a machine without an accelerator, so it cannot run on CPU/gloo; the hooks it would
    install are the same.
    """
    # diffusers and transformers load with a model, not for `causalkv plugins` / `resolve`
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel

    plan = getattr(transformer, "_cp_plan", None)
    if plan is None:
        raise ConfigError(
            f"{type(transformer).__name__} declares no context-parallel plan (_cp_plan); "
            "run it on one process (--nproc-per-node 1)"
        )
    # causalkv calls the model with one timestep per call ([B]); the plan's per-token timestep
    # split (Wan 2.2 TI2V, key "") would only warn that it does not apply
    plan = {k: v for k, v in plan.items() if k != ""}
    # diffusers' gather still calls a functional collective torch deprecates (same result)
    warnings.filterwarnings("ignore", message=".*all_gather_tensor.* is deprecated", category=FutureWarning)
    config = ContextParallelConfig(ulysses_degree=ctx.world_size)
    mesh = init_device_mesh(
        ctx.device.type, mesh_shape=config.mesh_shape, mesh_dim_names=config.mesh_dim_names
    )
    config.setup(ctx.rank, ctx.world_size, ctx.device, mesh=mesh)
    apply_context_parallel(transformer, config, plan)
