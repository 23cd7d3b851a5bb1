"""``causalkv generate`` from the command line: video, metrics, --compare-bf16, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from causalkv.cli import main
from causalkv.runtime.host.compare_step import latent_psnr_db

REQUIRED_METRICS = {"stage", "cache", "chunks", "seconds_per_chunk", "kv_resident_bytes_max",
                    "kv_resident_bytes_final"}


def test_generate_writes_mp4_and_metrics_with_compare(
    causalkv_home: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, metrics_path = tmp_path / "v.mp4", tmp_path / "m.json"
    # bf16 caches under float32 compute: --compare-bf16's reference is a bf16 cache
    rc = main(["generate", "--model", "tiny-wan", "--frames", "12", "--dtype", "float32",
               "--kv-cache-dtype", "bfloat16",
               "--kv-cache-quant", "int2", "--compare-bf16", "--seed", "3", "--quiet",
               "--output", str(out), "--metrics", str(metrics_path)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "stage: self-forcing-wan" in printed and "cache: qvg" in printed
    m = json.loads(metrics_path.read_text())
    assert REQUIRED_METRICS <= set(m)
    assert (m["stage"], m["cache"], m["chunks"]) == ("self-forcing-wan", "qvg", 4)
    assert len(m["seconds_per_chunk"]) == 4 and all(s > 0 for s in m["seconds_per_chunk"])
    assert m["kv_resident_bytes_max"] >= m["kv_resident_bytes_final"] > 0
    assert m["reference_cache"] == "dense" and m["reference_kv_cache_dtype"] == "bfloat16"
    assert m["kv_resident_bytes_max"] < m["reference_kv_resident_bytes_max"]
    assert isinstance(m["latent_psnr_db"], float) and math.isfinite(m["latent_psnr_db"])
    assert m["latent_psnr_db"] > 0
    # Wan's causal VAE: 12 latent frames -> 1 + 4 * 11 = 45 frames of 64x64
    assert (m["video_frames"], m["video_size"]) == (45, [64, 64])
    assert out.exists() and out.read_bytes()[4:8] == b"ftyp"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--frames", "7"], "frames=7 is not divisible by frames per chunk=3"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--model", "tiny-longlive", "--window-frames", "2"], "smaller than a chunk of 3 frames"),
        (["--model", "tiny-longlive", "--sink-frames", "-2"], "--sink-frames must be an int >= 0, got -2"),
        (["--prompt", ""], "prompts must be non-empty text"),
        (["--kv-cache-quant-centroids", "0"], "kv-cache-quant-centroids must be > 0"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    causalkv_home: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    rc = main(["generate", "--quiet", "--output", str(tmp_path / "x.mp4"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.startswith("causalkv generate: error:")
    assert not (tmp_path / "x.mp4").exists()


def test_latent_psnr_matches_its_definition() -> None:
    import torch

    ref = torch.tensor([0.0, 1.0, 2.0, 4.0])
    got = ref + torch.tensor([0.1, -0.1, 0.1, -0.1])
    # peak = 4 - 0, mse = 0.01 -> 10 log10(16 / 0.01) = 32.04 dB
    assert latent_psnr_db(got, ref) == pytest.approx(10 * math.log10(16 / 0.01))
    assert latent_psnr_db(ref, ref) is None
