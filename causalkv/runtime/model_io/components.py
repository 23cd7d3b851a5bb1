"""Loading a model folder's components with diffusers and transformers ``from_pretrained``.

- transformer: diffusers ``WanTransformer3DModel``, wrapped in `CausalWanTransformer`
  (causal processors installed; weights untouched);
- text: transformers ``UMT5EncoderModel`` + ``AutoTokenizer`` -> `PromptEncoder`;
- vae: diffusers ``AutoencoderKLWan`` (loaded only when the video is decoded).
"""

from __future__ import annotations

import importlib.util
import logging
import logging.handlers
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

from causalkv.config import DTYPES
from causalkv.errors import CausalKVError, ConfigError, describe_exception
from causalkv.runtime.model_io.causal_wan import CausalWanTransformer
from causalkv.runtime.model_io.model_config import ModelFolderError, RuntimeModelInfo
from causalkv.runtime.model_io.prompt_encoding import PromptEncoder, warn_line

__all__ = [
    "Components",
    "LoadMemoryError",
    "load_components",
    "load_wan_transformer", "load_vae", "parse_dtype",
    "captured_library_warnings", "reading_component"]

#: the libraries whose log records a load captures (their own handlers print several lines)
CAPTURED_LOGGERS = ("diffusers", "transformers")


def _one_line(text: str) -> str:
    first, *rest = [line.strip() for line in str(text).splitlines() if line.strip()] or [""]
    return first + (f" (+{len(rest)} more line{'s' if len(rest) > 1 else ''})" if rest else "")


@contextmanager
def captured_library_warnings(what: str) -> Iterator[None]:
    """Within the block, the warnings diffusers and transformers log and Python ``warnings``
    are captured instead of printed (their multi-line texts would precede causalkv's own
    line); each becomes one ``causalkv: warning: <what>: <first line> (+N more lines)`` line
    when the block succeeds. When it raises, the error's one line says what went wrong and the
    captured texts are dropped (``--debug`` shows the traceback)."""
    collect = logging.handlers.BufferingHandler(sys.maxsize)  # keeps every record (flushed never)
    collect.setLevel(logging.WARNING)
    saved = []
    for name in CAPTURED_LOGGERS:
        # configured now, so no handler of theirs arrives later (not installed: nothing to capture)
        with suppress(ImportError):
            importlib.import_module(f"{name}.utils.logging").get_logger(name)
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers = [collect]
        logger.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:  # the filters stay as they are
            yield
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate
    texts = [r.getMessage() for r in collect.buffer] + [str(w.message) for w in caught]
    for text in dict.fromkeys(t for t in (_one_line(t) for t in texts) if t):
        warn_line(f"{what}: {text}")

#: `causalkv.config.DTYPES` and their short aliases, as torch dtypes
_DTYPES = {
    **{name: getattr(torch, name) for name in DTYPES},
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A name of `causalkv.config.DTYPES` (``"bfloat16"`` / ``"float16"`` / ``"float32"``), its
    alias (``bf16`` / ``fp16`` / ``fp32``) or a torch dtype -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {name!r}") from None


def _has_accelerate() -> bool:
    return importlib.util.find_spec("accelerate") is not None


def load_wan_transformer(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``WanTransformer3DModel.from_pretrained(path)`` in ``dtype``, fp32 modules kept fp32.

    diffusers refuses to load a model that declares ``_keep_in_fp32_modules`` (Wan does)
    when ``accelerate`` is not installed. Without accelerate the declaration is lifted for
    the duration of the call, the checkpoint loads in float32, and the parameters are cast as
    ``from_pretrained(torch_dtype=...)`` casts them: one stays float32 when a component of its
    dotted name is declared (Wan: rope, time_embedder, scale_shift_table, norm1/2/3); buffers
    (RoPE tables) are left as they are.
    """
    # diffusers and transformers load with a model, not for `causalkv plugins` / `resolve`
    from diffusers import WanTransformer3DModel as cls

    if _has_accelerate():
        return cls.from_pretrained(path, torch_dtype=dtype, local_files_only=True)
    declared = set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    # lifted for the call; patch.object restores the class as it was (inherited or its own)
    with patch.object(cls, "_keep_in_fp32_modules", None):
        model = cls.from_pretrained(path, torch_dtype=torch.float32, low_cpu_mem_usage=False, local_files_only=True)
    if dtype != torch.float32:
        for name, param in model.named_parameters():
            if param.is_floating_point() and not declared.intersection(name.split(".")):
                param.data = param.data.to(dtype)
    return model


def _all_weights_loaded(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, unless the checkpoint lacked some of its parameters (diffusers leaves them on
    the meta device, where the first ``.to(device)`` would fail): ValueError naming one."""
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(
            f"{len(missing)} parameter(s) of the config are missing from the weights, e.g. {missing[0]!r}"
        )
    return model


class LoadMemoryError(CausalKVError, MemoryError):
    """A component ran out of memory while it loaded (exit status 1: the files are fine)."""

    exit_code = 1


_OOM_TEXT = ("can't allocate memory", "not enough memory", "out of memory", "cannot allocate memory")


@contextmanager
def reading_component(folder: Path, component: str, *, preset: str | None = None) -> Iterator[None]:
    """Turn a failure to read ``folder/component`` (corrupt config or weights, missing file,
    unreadable tokenizer) into a one-line `ModelFolderError` with the fix, and running out of
    memory into `LoadMemoryError` (not a corrupt file). causalkv's own errors pass through.
    The libraries' warnings are captured (`captured_library_warnings`)."""
    try:
        with captured_library_warnings(f"loading {component}"):
            yield
    except CausalKVError:
        raise
    except Exception as exc:  # noqa: BLE001 - what from_pretrained raises varies by library
        what = describe_exception(exc)
        if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)
        ):
            raise LoadMemoryError(
                f"loading {component} from {str(folder / component)!r} ran out of memory ({what}); "
                "free memory, load in a smaller --dtype, or use a smaller model"
            ) from exc
        fix = (
            f"delete the preset folder {str(folder)!r}; it is rebuilt on the next run"
            if preset is not None
            else "restore the component's files (re-download or re-convert the model)"
        )
        raise ModelFolderError(f"cannot load {component} from {str(folder / component)!r} ({what}); {fix}") from exc


@dataclass
class Components:
    """The loaded model: causal transformer, prompt encoder and their device (the stage builds
    its own sampler, ``scheduler_spec(model)``), and the seconds the load took
    (`causalkv.runtime.host.load_step.load_for_plan` sets it: a preset's first build included)."""

    transformer: CausalWanTransformer
    prompt_encoder: PromptEncoder
    device: torch.device
    load_seconds: float = 0.0


def load_components(
    info: RuntimeModelInfo, folder: str | Path, *, dtype: str | torch.dtype = "bfloat16", device: str = "cpu"
) -> Components:
    """Load transformer, text encoder and tokenizer from ``folder`` with ``from_pretrained``."""
    # diffusers and transformers load with a model, not for `causalkv plugins` / `resolve`
    from transformers import AutoTokenizer, UMT5EncoderModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars of tiny checkpoints are noise
    folder = Path(folder)
    torch_dtype = parse_dtype(dtype)
    dev = torch.device(device)
    with reading_component(folder, "transformer", preset=info.preset):
        model = _all_weights_loaded(load_wan_transformer(folder / "transformer", torch_dtype))
    model = model.to(dev).eval()
    with reading_component(folder, "text_encoder", preset=info.preset):
        text_encoder = _all_weights_loaded(
            UMT5EncoderModel.from_pretrained(folder / "text_encoder", dtype=torch_dtype, local_files_only=True)
        )
    text_encoder = text_encoder.to(dev).eval()
    with reading_component(folder, "tokenizer", preset=info.preset):
        tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True)
    prompt_encoder = PromptEncoder(
        tokenizer, text_encoder, max_length=info.text_max_length, device=dev, dtype=torch_dtype
    )
    return Components(CausalWanTransformer(model), prompt_encoder, dev)


def load_vae(folder: str | Path, *, device: str | torch.device = "cpu") -> Any:
    """diffusers ``AutoencoderKLWan`` from ``folder/vae`` (float32: decoding is done once)."""
    # diffusers and transformers load with a model, not for `causalkv plugins` / `resolve`
    from diffusers import AutoencoderKLWan

    with reading_component(Path(folder), "vae"):
        vae = _all_weights_loaded(AutoencoderKLWan.from_pretrained(
            Path(folder) / "vae", torch_dtype=torch.float32, low_cpu_mem_usage=_has_accelerate(),
            local_files_only=True,
        ))
    return vae.to(device).eval()
