"""The README's main command, ``vllm-omni-edge demo``, end to end on the default model."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import BIN, vllm_env

pytestmark = pytest.mark.e2e


def test_demo_serves_the_default_model_cpu_int4_eager_in_one_process_and_answers(default_model):
    done = subprocess.run([str(BIN / "vllm-omni-edge"), "demo", "--max-tokens", "24"],
                          capture_output=True, text=True, timeout=900, env=vllm_env())
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "(one process, cpu_int4)" in out
    # compile_choice: the decoder stack runs the default model's decode, so nothing is compiled.
    assert "eager: the C++ decoder stack runs its decode steps" in out, out[-3000:]
    # The server's own kernel summary: every linear, the head and the embedding (format 3) on a
    # 4-bit kernel, none on the fallback.
    kernels = re.search(r"cpu_int4: 122 layers, kernels (\{[^}]*\})", out)
    assert kernels, out[-3000:]
    assert all(part in kernels.group(1) for part in ("'fallback': 0", "'lm_head:", "'embedding:")), kernels.group(1)
    answer = out.split("A: ", 1)[1]
    assert "Paris" in answer, answer[:500]
    decode = float(re.search(r"decode: ([0-9.]+) tok/s over 128 tokens", out).group(1))
    assert decode > 0
    processes = int(re.search(r"server tree PSS \d+ MiB over (\d+) processes", out).group(1))
    assert processes == 1, out[-1500:]
    assert re.search(r"server stopped \(exit code 0\)", out), out[-500:]
