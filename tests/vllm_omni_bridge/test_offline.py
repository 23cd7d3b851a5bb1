"""vLLM-Omni's offline entry point, ``Omni(model=DIR).generate(...)``, runs on a CPU with
causalkv's store inside (``demo/vllm_omni/run_offline.py``, a fresh process: ``Omni`` sets up
its own process groups): the tiny checkpoint, the CPU stand-ins and the demo's stand-in
pipeline (the DiT at the checkpoint's geometry, registered with ``register_diffusion_model``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "demo" / "vllm_omni" / "run_offline.py"


def test_omni_generates_through_causalkvs_int2_store_on_a_cpu(tmp_path):
    """One request of four 3-frame blocks (45 video frames of 64x64) through vLLM-Omni's engine,
    stage, worker, loader, LingBot's pre-process, DMD blocks, VAE decode and post-process:
    the pipeline put causalkv's int2 store on the DiT and logged one summary whose dense bytes
    are vLLM-Omni's ``[B, max_tokens, H, D]`` K and V (2 layers, 144 tokens, 2 heads x 64,
    float32) and whose resident bytes are fewer."""
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                             "MASTER_PORT", "CAUSALKV_VLLM_OMNI")}
    proc = subprocess.run([sys.executable, str(DEMO), "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["outputs"] == 1
    assert result["video_shape"][-4:] == [45, 64, 64, 3]
    (installed,) = result["installed"]
    assert "self-attention cache QVGPackedCausalKVCache qvg(int2" in installed
    (summary,) = result["summary"]
    fields = dict(re.findall(r"(\w+)=(\S+)", summary))
    assert fields["cache"] == "QVGPackedCausalKVCache" and fields["bits"] == "int2"
    assert fields["layers"] == "2"
    dense = 2 * 2 * 144 * 2 * 64 * 4
    assert int(fields["dense_bytes"]) == dense
    assert 0 < int(fields["resident_bytes"]) < dense
    assert int(fields["peak_bytes"]) < int(fields["dense_peak_bytes"])
