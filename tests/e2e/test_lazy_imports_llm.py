"""LLM() on the default model answers with lazy_imports on, the same greedy text as with it off,
and the deferred packages stay unloaded through load, compile-cache load and generation;
structured output (xgrammar) still works with triton hidden."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import vllm_env

pytestmark = pytest.mark.e2e

DEFERRED_ON_TEXT_PATH = ("av", "cv2", "scipy.signal", "scipy.optimize")

PROBE = (
    "import json, sys\n"
    "from vllm import LLM, SamplingParams\n"
    "from vllm_omni_edge.models.default_model import SMOKE_QUESTION\n"
    "from vllm_omni_edge.patches.common import lazy_imports as L\n"
    "llm = LLM(model=sys.argv[1], max_model_len=2048)\n"
    "out = llm.chat([{'role': 'user', 'content': SMOKE_QUESTION}],"
    " SamplingParams(temperature=0, max_tokens=24))\n"
    "state = {n: 'deferred' if L.is_deferred(sys.modules[n]) else 'loaded' for n in %r}\n"
    "from vllm.sampling_params import StructuredOutputsParams\n"
    "schema = {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}\n"
    "js = llm.chat([{'role': 'user', 'content': 'What is the capital of France? Reply in JSON.'}],"
    " SamplingParams(temperature=0, max_tokens=40,"
    " structured_outputs=StructuredOutputsParams(json=schema)))[0].outputs[0].text\n"
    "print('PROBE-RESULT ' + json.dumps({'text': out[0].outputs[0].text, 'state': state, 'json': js,"
    " 'triton_hidden': sys.modules.get('triton', 0) is None}))\n" % (DEFERRED_ON_TEXT_PATH,)
)


def _probe(model, flag: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(model)], capture_output=True, text=True,
                          timeout=900, env=vllm_env(VLLM_OMNI_EDGE_LAZY_IMPORTS=flag))
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE-RESULT "):
            return json.loads(line.removeprefix("PROBE-RESULT "))
    raise AssertionError(proc.stdout[-3000:] + proc.stderr[-6000:])


def test_llm_answers_with_lazy_imports_and_matches_eager_imports():
    from vllm_omni_edge.models.default_model import DEFAULT_MODEL, pull_cpu_int4_model

    model = pull_cpu_int4_model(DEFAULT_MODEL)
    lazy = _probe(model, "1")
    assert "Paris" in lazy["text"]
    assert lazy["state"] == {n: "deferred" for n in DEFERRED_ON_TEXT_PATH}
    assert lazy["triton_hidden"]
    assert isinstance(json.loads(lazy["json"])["city"], str)  # the grammar held the output to the schema
    eager = _probe(model, "0")
    assert eager["state"] == {n: "loaded" for n in DEFERRED_ON_TEXT_PATH}
    assert eager["text"] == lazy["text"]
