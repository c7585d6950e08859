"""A seeded request whose prompt is read in chunks: its CPU generator is rewound by state, and the
engine no longer dies on vLLM's offset rewind."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from tests.e2e.probe import run_script_probe
from vllm_omni_edge.patches.worker import seeded_prompt_chunk as patch


class _Runner:
    """What the two wrapped methods touch, with vLLM's rewind as the original bookkeeping."""

    def __init__(self, generators, discard):
        self.input_batch = types.SimpleNamespace(generators=generators, num_reqs=len(discard))
        self.discard_request_mask = types.SimpleNamespace(np=np.array(discard))

    def _sample(self, n=8):
        for g in self.input_batch.generators.values():
            torch.rand(n, generator=g)
        return "sampled"

    def _bookkeeping_sync(self):
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return "kept"


def _seeded(seed):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _patched():
    cls = type("Runner", (_Runner,), {})
    cls._sample = patch._make_sample(_Runner._sample)
    cls._bookkeeping_sync = patch._make_bookkeeping(_Runner._bookkeeping_sync)
    return cls


def test_vllms_rewind_raises_on_a_cpu_generator():
    runner = _Runner({0: _seeded(7)}, [True])
    runner._sample()
    with pytest.raises(RuntimeError, match="does not use offset"):
        runner._bookkeeping_sync()


def test_a_discarded_draw_leaves_the_generator_where_it_was_and_a_kept_one_advances_it():
    discarded, kept = _seeded(7), _seeded(11)
    before = discarded.get_state().clone(), kept.get_state().clone()
    runner = _patched()({0: discarded, 2: kept}, [True, False, False])
    assert runner._sample() == "sampled"
    assert runner._bookkeeping_sync() == "kept"
    assert torch.equal(discarded.get_state(), before[0])
    assert not torch.equal(kept.get_state(), before[1])
    # The real generators are back in the batch, and the next draw of the rewound one is the first.
    assert runner.input_batch.generators == {0: discarded, 2: kept}
    assert torch.equal(torch.rand(8, generator=discarded), torch.rand(8, generator=_seeded(7)))


def test_nothing_seeded_discarded_runs_vllms_code():
    g = _seeded(3)
    runner = _patched()({1: g}, [True, False])
    runner._sample()
    assert patch._SAVED_ATTR not in runner.__dict__
    runner._bookkeeping_sync()  # index 1 is kept: vLLM's loop never touches its generator
    assert runner._bookkeeping_sync() == "kept"


def test_only_the_batchs_rows_and_cpu_generators_are_kept():
    g = _seeded(5)
    other = types.SimpleNamespace(device=torch.device("meta"), get_state=lambda: pytest.fail("read"))
    states = patch.kept_states({0: g, 1: other, 4: _seeded(1)}, np.array([True, True, True, True, True]), 2)
    assert list(states) == [0] and torch.equal(states[0], g.get_state())


def test_wrapped_once():
    module = types.ModuleType("fake_runner_module")
    module.GPUModelRunner = type("GPUModelRunner", (_Runner,), {})
    patch._wrap(module)
    first = module.GPUModelRunner._sample, module.GPUModelRunner._bookkeeping_sync
    patch._wrap(module)
    assert (module.GPUModelRunner._sample, module.GPUModelRunner._bookkeeping_sync) == first


# A seeded request whose 40-token prompt is read 16 tokens a step, twice with the fix (the second
# may find part of the prompt cached: fewer chunks, the same draws), then, with vLLM's rewind put
# back, another 40-token prompt.
PROBE = (
    "import json, sys\n"
    "from vllm import LLM, SamplingParams\n"
    "from vllm.v1.worker import gpu_model_runner as g\n"
    "llm = LLM(model=sys.argv[1], max_model_len=512, max_num_seqs=2, max_num_batched_tokens=16,\n"
    "          kv_cache_memory_bytes=64 << 20)\n"
    "ids = llm.get_tokenizer().encode('Tell me about the sea, the wind, the hills and the boats. ' * 4)[:40]\n"
    "sp = SamplingParams(temperature=0.9, seed=1234, max_tokens=12, ignore_eos=True)\n"
    "run = lambda p: list(llm.generate([{'prompt_token_ids': p}], sp, use_tqdm=False)[0].outputs[0].token_ids)\n"
    "first, second = run(ids), run(ids)\n"
    "g.GPUModelRunner._bookkeeping_sync = g.GPUModelRunner._bookkeeping_sync.__wrapped__\n"
    "try:\n"
    "    run(ids[1:] + ids[:1])  # another prompt: no cached prefix, read in chunks again\n"
    "    stock = 'completed'\n"
    "except Exception as e:\n"
    "    stock = repr(e)\n"
    "print('PROBE-RESULT ' + json.dumps({'first': first, 'second': second, 'stock': stock}))\n"
)


@pytest.mark.e2e
def test_a_seeded_request_with_a_chunked_prompt_completes_and_repeats():
    from vllm_omni_edge.models.default_model import DEFAULT_MODEL, pull_cpu_int4_model

    result = run_script_probe(PROBE, str(pull_cpu_int4_model(DEFAULT_MODEL)))
    assert len(result["first"]) == 12 and result["first"] == result["second"], result
    # Without the fix, vLLM's rewind is what the engine runs into.
    assert "does not use offset" in result["stock"] or "EngineDeadError" in result["stock"], result
