"""Run one greedy chat through ``vllm.LLM`` in a fresh process; print JSON.

Tests run this as a subprocess: vLLM spawns its engine core and worker from it,
and the plugin must take effect in each of them without help from the test.
Usage: python llm_probe.py MODEL '{"max_model_len": 512, ...}'
"""

import json
import sys


def main():
    from vllm import LLM, SamplingParams

    from vllm_omni_edge.models.default_model import SMOKE_QUESTION

    model, kwargs = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model, **kwargs)
    out = llm.chat(
        [{"role": "user", "content": SMOKE_QUESTION}],
        SamplingParams(temperature=0, max_tokens=24),
    )
    print("PROBE-RESULT " + json.dumps({"text": out[0].outputs[0].text}))


if __name__ == "__main__":
    main()
