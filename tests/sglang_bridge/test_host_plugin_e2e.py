"""The host plugin distribution through sglang's own command line, ``sglang generate`` (a
subprocess on sglang's CPU platform), on the tiny LongLive 2.0 checkpoint, two shots.

``causalkv-host-plugin`` is pip-installed into a folder put first on the subprocess's PYTHONPATH
(found through importlib.metadata, as installed). Its sglang pipeline
(``causalkv_host_plugin.sglang_pipeline``: LongLive 2.0's pipeline running the plugin's
``ToyLongLive2Stage``) joins sglang's registry through sglang's own extension point,
``SGLANG_EXTERNAL_MODEL_PACKAGE``, and the checkpoint's ``model_index.json`` names it. causalkv's
registry decides the rest: the stage is served because ``toy-host`` registers it, its blocks are
built by the registration's cache factory (``toy-sglang``), and they pack with the registration's
codec (``toy-codec``'s int8) while ``--kv-cache-quant int2`` turns QVG on. The worker's log names
all three, and the request's bytes are what `causalkv memory` counts for ``int8-default`` from
the codec's ``nbytes`` (`e2e.planner_matches`)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from e2e import planner_matches, serving_lines, summaries
from longlive2_request import GEOMETRY, read_video, run_cli

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # plugin_dists, the test distributions' installer
    sys.path.insert(0, str(TESTS))
from plugin_dists import environment, found_in_process, install  # noqa: E402

TOY = "ToyLongLive2Pipeline"


@pytest.fixture(scope="module")
def toy_run(longlive2_checkpoint, tmp_path_factory):
    """``sglang generate --kv-cache-quant int2`` on the tiny checkpoint under the plugin's
    pipeline name: (rc, log, video, the installed folder)."""
    root = tmp_path_factory.mktemp("host-e2e")
    site = install("causalkv-host-plugin", root / "dist")
    ckpt = root / "tiny-toy-longlive2"
    shutil.copytree(longlive2_checkpoint, ckpt)
    index = json.loads((ckpt / "model_index.json").read_text())
    (ckpt / "model_index.json").write_text(json.dumps({**index, "_class_name": TOY}))
    env = environment(site, SGLANG_EXTERNAL_MODEL_PACKAGE="causalkv_host_plugin.sglang_pipeline")
    rc, log, video = run_cli(ckpt, root, "toy", "--kv-cache-quant", "int2", env=env, timeout=900)
    (root / "toy.log").write_text(log)
    return rc, log, video, site


def test_sglang_generate_serves_the_plugins_stage_cache_and_codec(toy_run, longlive2_checkpoint, monkeypatch):
    rc, log, video, site = toy_run
    assert rc == 0, log[-3000:]
    serves = [line for line in log.splitlines() if "causalkv sglang bridge serves" in line]
    assert serves and all(line.endswith(f"{TOY}: ToyLongLive2Stage (plugin toy-host, cache toy-sglang, codec int8)")
                          for line in serves), log[-3000:]
    (alloc,) = serving_lines(log)
    assert ("ToyLongLive2Stage KV cache causalkv_host_plugin.sglang_cache.ToySGLangCache x 2 blocks, served by "
            "causalkv, qvg(int8,") in alloc
    (s,) = summaries(log)
    assert (s["stage"], s["cache"], s["codec"]) == ("ToyLongLive2Stage", "ToySGLangCache", "int8")
    assert int(s["packed_chunks"]) >= 1 and int(s["pinned_tokens"]) > 0
    frames = read_video(video)
    assert frames.shape == (GEOMETRY["num_frames"], GEOMETRY["height"], GEOMETRY["width"], 3) and frames.std() > 0
    with found_in_process(site, monkeypatch):  # the plugin's codec, for the planner's row
        from causalkv.plugin import collect

        collect()
        # peak, resident and dense bytes, from its nbytes; the geometry is the copied folder's
        # (the planner knows LongLive 2.0's shot sinks by the original's pipeline name)
        planner_matches(longlive2_checkpoint, log, "int8-default")
    print(f"sglang generate, host plugin: {alloc.split('causalkv sglang bridge: ')[1][:160]}; summary "
          f"peak {s['peak_bytes']} resident {s['resident_bytes']} dense {s['dense_bytes']} B")
