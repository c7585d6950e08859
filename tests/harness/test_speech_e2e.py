"""The speech grid's in-process baselines on the real weights, through the CLI and the runner.

faster-whisper int8 and float32 and whisper.cpp, one smoke pass each, from the committed grid
(its `serve` arm left out: a server pass alone takes several minutes on the 2-core box). Checks
that each ran as its evidence says, transcribed the fixtures and was scored. Run with -m e2e.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vllm_omni_edge_bench.harness import cli, runner

pytestmark = [pytest.mark.e2e]

GRID = Path(runner.__file__).parent / "grids" / "speech-whisper-base.yaml"
# Percent: above whisper-base's own errors on espeak-ng's voice (tests/e2e/test_whisper_serve.py
# bounds the server's at 0.15), far below what a broken engine or converter gives.
WER_MAX = 20.0


@pytest.mark.timeout(900)
def test_in_process_speech_arms_run_and_are_scored(tmp_path):
    from vllm_omni_edge.models.default_model import WHISPER_BASE, pull_model

    pull_model(WHISPER_BASE)
    grid = yaml.safe_load(GRID.read_text())
    grid["arms"] = [arm for arm in grid["arms"] if arm["engine"] != "speech-server"]
    assert {arm["engine"] for arm in grid["arms"]} == {"faster-whisper", "whispercpp"}
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump(grid))
    out = tmp_path / "results"
    code = cli.main(["run", str(grid_file), "--smoke", "--passes", "1", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert code == cli.EXIT_OK, summary
    for arm in grid["arms"]:
        figures = summary["arms"][arm["name"]]
        for n in (1, 4):
            assert figures[f"speech RTF@{n}"]["min"] > 0
            assert figures[f"speech WER@{n}"]["max"] <= WER_MAX, (arm["name"], figures[f"speech WER@{n}"])
        assert figures["tree PSS steady"]["min"] > 100 << 20
    record = json.loads((out / "passes" / "01-whispercpp-f16.json").read_text())
    (worker,) = record["evidence"]["workers"]
    assert worker["model_path"].endswith(".bin") and worker["converted_from"].endswith("whisper-base")
    assert "AVX2 = 1" in worker["system_info"]
    assert "**Smoke run**" in (out / "report.md").read_text()
