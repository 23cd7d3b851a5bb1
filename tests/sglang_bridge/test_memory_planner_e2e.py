"""`causalkv memory` on an sglang folder equals what ``sglang generate`` logs for it.

The tiny LongLive 2.0 checkpoint (``causalkv sglang-checkpoint longlive2``), the two-shot
request of the end-to-end tests (256x256, 29 frames = 4 chunks of 2, the cut at chunk 2
pinned), int2 at sglang's defaults and keep-recent 0: the planner, reading the folder's
config, gives the bridge's ``causalkv kv-cache summary:`` figures to the byte (``peak_bytes``,
``resident_bytes``, ``dense_bytes``).
"""

from __future__ import annotations

import pytest
from e2e import summaries
from longlive2_request import GEOMETRY, SHOTS, run_cli

from causalkv.runtime.memory import MemoryRequest, plan_memory, read_model_geometry

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("setting", "flags"), [
    ("int2-default", ("--kv-cache-quant", "int2")),
    ("int2-recent0", ("--kv-cache-quant", "int2", "--kv-cache-quant-keep-recent", "0")),
])
def test_planner_equals_sglang_generates_summary(longlive2_checkpoint, tmp_path, setting, flags):
    rc, log, _ = run_cli(longlive2_checkpoint, tmp_path, setting, *flags)
    assert rc == 0, log[-3000:]
    (s,) = summaries(log)
    geom = read_model_geometry(longlive2_checkpoint)
    req = MemoryRequest(height=GEOMETRY["height"], width=GEOMETRY["width"],
                        frames=GEOMETRY["num_frames"], shots=len(SHOTS["shot_prompts"]))
    (row,) = plan_memory(geom, req, settings=[setting]).rows
    assert (int(s["peak_bytes"]), int(s["resident_bytes"]), int(s["dense_bytes"])) == (
        row.peak_bytes, row.kv_bytes, row.dense_bytes)
