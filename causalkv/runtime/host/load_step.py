"""Step 2 of `causalkv.runtime.host.generate`: load the plan's model.

`load_for_plan` joins the ranks of a sequence-parallel request, materializes a preset on first
use (once per node), loads the components with ``from_pretrained`` and makes the transformer
one rank of the job. The stage is built over them by the next step
(`causalkv.runtime.host.run_step.build_stage`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from causalkv.runtime.files.file_checks import fs_error_reason
from causalkv.runtime.files.outputs import OutputWriteError
from causalkv.runtime.host.pipeline_records import DEFAULT_PROMPT, Plan
from causalkv.runtime.model_io.components import Components, load_components
from causalkv.runtime.model_io.model_config import RuntimeModelInfo
from causalkv.runtime.model_io.preset_configs import causalkv_home
from causalkv.runtime.model_io.presets import materialize_preset
from causalkv.runtime.processes.distributed import join_ranks, local_main_first

__all__ = ["load_for_plan", "model_folder"]


def model_folder(info: RuntimeModelInfo, *, pm: Any = None, registry: Any = None) -> Path:
    """The folder to load from: a preset is created on first use."""
    if info.preset is not None:
        try:
            return materialize_preset(info.preset, pm=pm, registry=registry)
        except OSError as exc:  # a file system that fills up or turns read-only while it builds
            where = info.path.parent if info.path is not None else causalkv_home()
            raise OutputWriteError(
                f"could not build the preset {info.preset!r} in {str(where)!r} "
                f"({fs_error_reason(exc, where)}); nothing was left there; free some space or set "
                "CAUSALKV_HOME to a writable folder"
            ) from None
    assert info.path is not None
    return info.path


def load_for_plan(plan: Plan, *, pm: Any = None) -> Components:
    """Load the plan's model components (a preset folder is built on first use, by each
    node's first rank), as one rank of the job when the request is sequence parallel;
    ``components.load_seconds``: how long all of it took."""
    started = time.perf_counter()
    args = plan.server_args
    ctx = join_ranks(args.heads_sharded, args.device)  # before the preset: the ranks share one folder
    folder = local_main_first(lambda: model_folder(plan.info, registry=plan.plugin_set(pm).registry))
    components = load_components(plan.info, folder, dtype=args.dtype, device=args.device)
    # the host's own default prompt is not the user's: its cut on a tiny preset is not reported
    components.prompt_encoder.quiet_texts = frozenset({DEFAULT_PROMPT})
    if ctx is not None:  # the transformer becomes one rank of the job
        components.transformer.enable_sequence_parallel(ctx)
    components.load_seconds = time.perf_counter() - started
    return components

