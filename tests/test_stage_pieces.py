"""The stage's pieces: the sampler declared as data, typed chunk stats, no runtime import,
each object writing only its own fields."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import causalkv.stages
from causalkv.config import ModelConfig
from causalkv.hooks import specs
from causalkv.stages.base import CausalDenoisingStage
from causalkv.stages.longlive2 import LongLive2Stage
from causalkv.stages.records import ChunkStats
from causalkv.stages.scheduler import FLOW_MATCH_EULER, SchedulerSpec

MODEL = ModelConfig("m", "WanPipeline", 1, 1, 8, 1, 1, shift=3.0)


def _is_own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own fields."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def test_no_stage_module_touches_another_objects_private_fields() -> None:
    """The stage split by job (docs/design.md): a stage, its chunk loop and its caches each
    read and write only their own ``_private`` fields; the stream's state is the loop's
    (`ChunkLoop.token_end`/`cache_frames`, written through `restart`/`extend`)."""
    found = []
    for path in sorted(Path(causalkv.stages.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and not _is_own(node.value)):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not found, found


def test_the_stages_import_nothing_of_the_runtime() -> None:
    """Declaring and planning a stage needs no host: the built-in stage modules, their
    schedulers' declarations and their planning import no ``causalkv.runtime`` module."""
    code = (
        "import sys\n"
        "from causalkv.config import ModelConfig, ServerArgs\n"
        "from causalkv.stages import families, lingbot, longlive, longlive2, wan\n"
        "m = ModelConfig('m', 'LongLive2Pipeline', 1, 1, 8, 1, 2)\n"
        "longlive2.LongLive2Stage.scheduler_spec(m)\n"
        "longlive2.LongLive2Stage.plan_chunks(['a', 'b'], 4, ServerArgs(multi_shot=True))\n"
        "lingbot.LingBotWorldStage.check_request(m, ServerArgs(), 4)\n"
        "loaded = sorted(n for n in sys.modules if n.startswith('causalkv.runtime'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_sampler_is_declared_and_built_from_the_declaration() -> None:
    spec = CausalDenoisingStage.scheduler_spec(MODEL)
    assert spec == SchedulerSpec(FLOW_MATCH_EULER, {"num_train_timesteps": 1000, "shift": 3.0})
    sched = CausalDenoisingStage.scheduler_spec(MODEL).build()
    assert type(sched).__name__ == "FlowMatchEulerDiscreteScheduler" and sched.config.shift == 3.0
    unipc = LongLive2Stage.scheduler_spec(MODEL)
    assert unipc.target == "diffusers:UniPCMultistepScheduler" and unipc.config["flow_shift"] == 3.0
    assert type(LongLive2Stage.scheduler_spec(MODEL).build()).__name__ == "UniPCMultistepScheduler"


def test_chunk_stats_read_by_attribute_and_by_key() -> None:
    s = ChunkStats(chunk=1, frames=(3, 6), token_start=48, rope_frame_start=3.0, prompt="p",
                   seconds=0.5, kv_resident_bytes=1024, visible_tokens=96)
    assert s.seconds == s["seconds"] == s.get("seconds") == 0.5
    assert dict(s) == {"chunk": 1, "frames": (3, 6), "token_start": 48, "rope_frame_start": 3.0,
                       "prompt": "p", "seconds": 0.5, "kv_resident_bytes": 1024, "visible_tokens": 96}
    assert s.get("cache_bytes") is None and "cache_bytes" not in s


def test_the_chunk_done_hookspec_names_exactly_the_stats_keys() -> None:
    """``causalkv_chunk_done``'s docstring lists the keys a plugin may read: the `ChunkStats`
    fields, no more (an undocumented key) and no less (a documented key no code emits)."""
    doc = specs.causalkv_chunk_done.__doc__ or ""
    listed = doc.split("mapping too:", 1)[1].split(")", 1)[0]
    assert set(re.findall(r"``(\w+)``", listed)) == {f.name for f in fields(ChunkStats)}
