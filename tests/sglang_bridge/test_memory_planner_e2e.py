"""`causalkv memory` on an sglang folder equals what ``sglang generate`` logs for it.

The tiny LongLive 2.0 checkpoint (``causalkv sglang-checkpoint longlive2``), the two-shot
request of the end-to-end tests (256x256, 29 frames = 4 chunks of 2, the cut at chunk 2
pinned), int2 at sglang's defaults and keep-recent 0: the planner, reading the folder's
config, gives the bridge's ``causalkv kv-cache summary:`` figures to the byte (``peak_bytes``,
``resident_bytes``, ``dense_bytes``). The default run is test_e2e_cli's own (one ``sglang
generate`` process serves both files' checks); keep-recent 0 runs here.
"""

from __future__ import annotations

from e2e import planner_matches
from longlive2_request import run_cli


def test_planner_equals_sglang_generates_summary_at_keep_recent_0(longlive2_checkpoint, tmp_path):
    rc, log, _ = run_cli(longlive2_checkpoint, tmp_path, "int2-recent0", "--kv-cache-quant", "int2",
                         "--kv-cache-quant-keep-recent", "0")
    assert rc == 0, log[-3000:]
    planner_matches(longlive2_checkpoint, log, "int2-recent0")
