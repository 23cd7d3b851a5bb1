"""The host plugin distribution through vLLM-Omni's offline entry point, ``Omni(model=DIR)
.generate(...)``, in a fresh process on a CPU (as test_offline.py runs ``make run-vllm-omni``'s
script): ``causalkv-host-plugin`` pip-installed into a folder first on the process's PYTHONPATH
(found through importlib.metadata, as installed), the tiny LingBot-World checkpoint, and
``model_class_name="ToyLingBotWorldPipeline"``, a name only the plugin's registration gives
vLLM-Omni (causalkv's ``register``, vLLM-Omni's general plugin). ``causalkv_kv_cache: {}`` names
no codec, so the registration's (``toy-codec``'s int8) packs, and its cache factory
(``toy-packed``) builds each layer's cache. The only stand-in of the demo used is the DiT's
``from_config`` at the checkpoint's tiny geometry (`tiny_pipeline._tiny_from_config`: vLLM-Omni's
refuses every geometry but LingBot-World v2's), set for the whole process; the worker runs in this
process, so the script also keeps the caches the factory builds, to count their bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # plugin_dists, the test distributions' installer
    sys.path.insert(0, str(TESTS))
from plugin_dists import environment, install  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "demo" / "vllm_omni"

SCRIPT = r"""
import json, logging, sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
import numpy as np
import PIL.Image
import run_offline, tiny_pipeline
from vllm_omni.diffusion.models.lingbot_world import transformer as lt
from vllm_omni.entrypoints.omni import Omni
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

import causalkv_host_plugin.caches as toy
from causalkv.caches.qvg.segments import PackedKV
from causalkv.runtime.tools.checkpoints import build_checkpoint

lt.CausalLingBotWorldTransformer3DModel.from_config = staticmethod(tiny_pipeline._tiny_from_config)
built = []  # every cache the plugin's factory builds (one per layer per request)
init = toy.ToyPackedCache.__init__
toy.ToyPackedCache.__init__ = lambda self, *a, **k: (init(self, *a, **k), built.append(self))[0]
work = Path(sys.argv[2])
frames = (4 * 3 - 1) * 4 + 1  # four blocks of 3 latent frames
run_offline._actions(work / "actions", frames)
folder = build_checkpoint("lingbot-world", work / "lingbot", host="vllm-omni")
lines = run_offline._Lines()
logging.getLogger("causalkv.vllm_omni").addHandler(lines)
omni = Omni(model=str(folder), model_class_name="ToyLingBotWorldPipeline", dtype="float32", enforce_eager=True,
            stage_init_timeout=600, model_config={"lingbot_action_root": str(work / "actions"), "causalkv_kv_cache": {}})
image = PIL.Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype("uint8"))
params = OmniDiffusionSamplingParams(height=64, width=64, num_frames=frames, seed=42, num_inference_steps=4,
                                     extra_args={"action_path": "walk"})
try:
    outs = omni.generate([{"prompt": "a fox trots through fresh snow", "multi_modal_data": {"image": image}}],
                         [params], use_tqdm=False)
finally:
    omni.shutdown()
    run_offline._undecorate()
packed = [s.storage for c in built for s in c.store.segments if isinstance(s.storage, PackedKV)]
print("RESULT " + json.dumps({
    "lines": lines.lines, "video": list(run_offline._video(outs[0]).shape), "caches": len(built),
    "classes": sorted({type(c).__name__ for c in built}),
    "resident": sum(c.resident_nbytes() for c in built),
    "packed": [[s.codec.name, s.nbytes, 2 * s.codec.nbytes(tuple(s.k.shape))] for s in packed],
}))
"""


def test_omni_generate_serves_the_plugins_pipeline_cache_and_codec(tmp_path):
    site = install("causalkv-host-plugin", tmp_path / "dist")
    env = environment(site)
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(DEMO), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    # register() may log before the capture
    lines = out["lines"] + [ln for ln in (proc.stdout + proc.stderr).splitlines() if not ln.startswith("RESULT ")]
    # each process vLLM-Omni loads its general plugins in logs it (some through vLLM's handlers)
    registered = {ln[ln.index("causalkv vllm-omni"):] for ln in lines if "causalkv vllm-omni bridge registered:" in ln}
    assert registered and all(r.rstrip().endswith(
        "ToyLingBotWorldPipeline -> causalkv_host_plugin.vllm_omni_pipeline.ToyLingBotWorldPipeline (plugin "
        "toy-host, cache toy-packed, codec int8)") for r in registered), registered
    (installed,) = {ln for ln in out["lines"] if "self-attention cache" in ln}
    assert installed.startswith("causalkv: LingBotWorldCausalDMDPipeline self-attention cache ToyPackedCache qvg(int8,")
    assert installed.endswith("(cache toy-packed, plugin toy-host) (served as ToyLingBotWorldPipeline, plugin toy-host)")
    (summary,) = {ln for ln in out["lines"] if ln.startswith("causalkv kv-cache summary:")}
    fields = dict(kv.split("=", 1) for kv in summary.split() if "=" in kv)
    assert (fields["pipeline"], fields["cache"], fields["codec"]) == ("ToyLingBotWorldPipeline", "ToyPackedCache", "int8")
    assert out["classes"] == ["ToyPackedCache"] and out["caches"] == int(fields["layers"])  # one request
    assert out["video"][-4:] == [45, 64, 64, 3]
    # the bytes: every packed record is what the codec's nbytes says (K and V), and the summary's
    # resident bytes are what the factory's caches hold at the end
    assert out["packed"] and all(codec == "int8" and held == predicted for codec, held, predicted in out["packed"])
    assert int(fields["resident_bytes"]) == out["resident"]
    print(f"Omni.generate, host plugin: {installed[:150]}; {summary}; packed records (codec, bytes, "
          f"2 x nbytes): {out['packed'][:4]}")


