"""Speech out with the thinker and talker in cpu_int4: the ``qwen2_5_omni_int4`` CPU deploy YAML.

Runs ``Omni`` (tests/omni/omni_probe.py in a subprocess) on the tiny random-weight
Qwen2.5-Omni with ``VLLM_OMNI_EDGE_EVIDENCE_DIR`` set, and checks the answer (text and a
valid WAV) and each stage worker's own evidence: the thinker and talker quantized their
linear layers and LM heads to cpu_int4 at load, code2wav did not.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, vllm_env
from tests.omni.test_e2e_speech import tiny_omni_model  # noqa: F401 (session fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _stage_workers(evidence_dir) -> dict[int, dict]:
    workers = [json.loads(p.read_text()) for p in sorted(evidence_dir.glob("worker-*.json"))]
    by_stage: dict[int, dict] = {}
    for worker in workers:
        assert worker["omni_stage_id"] not in by_stage, f"two workers claim stage {worker['omni_stage_id']}"
        by_stage[worker["omni_stage_id"]] = worker
    return by_stage


def test_int4_thinker_and_talker_return_text_and_wav(tiny_omni_model, tmp_path):  # noqa: F811
    import numpy as np
    import soundfile as sf

    from vllm_omni_edge.platforms.cpu.deploy import cpu_deploy_config

    deploy = cpu_deploy_config("qwen2_5_omni_int4", tmp_path / "deploy")
    evidence = tmp_path / "evidence"
    evidence.mkdir()
    wav = tmp_path / "out.wav"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.omni.omni_probe", str(tiny_omni_model), str(deploy), str(wav)],
        cwd=REPO, env=vllm_env(VLLM_OMNI_EDGE_EVIDENCE_DIR=str(evidence)), capture_output=True, text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["text_token_ids"]) == 8 and result["text"]  # ignore_eos, max_tokens 8
    assert result["audio_samples"] > 0 and result["sample_rate"] == 24000
    audio, rate = sf.read(io.BytesIO(wav.read_bytes()), dtype="float32")
    assert rate == 24000 and audio.ndim == 1 and audio.size == result["audio_samples"]
    assert np.isfinite(audio).all()

    by_stage = _stage_workers(evidence)
    assert set(by_stage) == {0, 1, 2}, sorted(by_stage)
    for stage, name in ((0, "thinker"), (1, "talker")):
        worker = by_stage[stage]
        assert worker["omni_stage"] == name
        assert worker["quantization"] == "cpu_int4", worker["quantization"]
        kernels = worker["cpu_int4_kernels"]
        linear = sum(n for k, n in kernels.items() if k.startswith("linear:") and not k.endswith(":unquantized"))
        head = sum(n for k, n in kernels.items() if k.startswith("lm_head:") and not k.endswith(":unquantized"))
        assert linear > 0 and head == 1, (name, kernels)
        # Every decoder linear of the tiny model has K divisible by 32 and N by 16: none is left out.
        assert not [layer for layer in worker["cpu_int4_other_layers"] if layer["kernel"] == "unquantized"
                    and ".layers." in layer["prefix"]], worker["cpu_int4_other_layers"]
        assert worker["weights_bytes_by_dtype"].get("uint8", 0) > 0  # the packed 4-bit weights
    code2wav = by_stage[2]
    assert code2wav["quantization"] is None and code2wav["cpu_int4_kernels"] == {}
