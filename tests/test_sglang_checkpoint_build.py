"""``causalkv sglang-checkpoint`` in causalkv's own environment (no sglang): the folder and the
printed command. That sglang loads and runs the folder is tested in the sglang environment
(tests/sglang_bridge/test_e2e_*.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors import safe_open

from causalkv.errors import ConfigError
from causalkv.runtime.tools.checkpoints import CHECKPOINTS, build_checkpoint


def test_builds_without_sglang_and_prints_the_command_last(tmp_path):
    folder = tmp_path / "ll2"
    code = (
        "import sys\n"
        "from causalkv.cli import main\n"
        f"assert main(['sglang-checkpoint', 'longlive2', {str(folder)!r}]) == 0\n"
        "assert not [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()
    assert out[-1].startswith(f"sglang generate --model-path {folder} --model-id LongLive-2.0-5B")
    assert "--kv-cache-quant int2" in out[-1]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "LongLive2Pipeline"
    assert {"transformer", "vae", "text_encoder", "tokenizer", "scheduler"} <= set(index)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "LongLive2Transformer3DModel"
    with safe_open(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.blocks.0.self_attn.q.weight" in keys and "model.head.head.weight" in keys
    assert not [k for k in keys if not k.startswith("model.")]  # LongLive's names only
    assert list(tmp_path.glob(".ll2.build-*")) == []  # the temporary build folder is gone


def test_a_complete_folder_is_kept_and_an_unrelated_one_refused(tmp_path):
    folder = build_checkpoint("wan-causal", tmp_path / "wan")
    stamp = (folder / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns
    assert build_checkpoint("wan-causal", folder) == folder
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns == stamp
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="is not a causalkv sglang checkpoint"):
        build_checkpoint("longlive2", tmp_path / "mine")
    with pytest.raises(ConfigError, match="choose one of: longlive2, wan-causal, lingbot"):
        build_checkpoint("nope", tmp_path / "x")
    assert CHECKPOINTS["wan-causal"].known_failure.startswith("sglang 0.5.23 cannot run")
