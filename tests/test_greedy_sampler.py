"""An all-greedy step is sampled by one argmax of the logits: vLLM's own sampler is the reference,
and every condition that could move the argmax or ask for more than the token keeps vLLM's path."""

from __future__ import annotations

import types

import pytest
import torch

from tests.e2e.probe import run_script_probe
from vllm_omni_edge.patches.worker import greedy_sampler as patch


def _processors(bias=False, min_tokens=False, other=False):
    from vllm.v1.sample.logits_processor import LogitsProcessors, builtin

    cpu = torch.device("cpu")
    logit_bias = builtin.LogitBiasLogitsProcessor(None, cpu, False)
    if bias:  # request 0 favours token 5 by 1e4
        logit_bias.biases = {0: {5: 1e4}}
        logit_bias.bias_tensor = torch.tensor([1e4])
        logit_bias.logits_slice = (torch.tensor([0]), torch.tensor([5]))
    least = builtin.MinTokensLogitsProcessor(None, cpu, False)
    if min_tokens:
        least.min_toks = {0: (3, [], {1}, False)}
    extra = [types.SimpleNamespace(is_argmax_invariant=lambda: False, apply=lambda x: x)] if other else []
    return LogitsProcessors([logit_bias, least, *extra])


def _metadata(rows, **changes):
    from vllm.v1.sample.metadata import SamplingMetadata

    fields = dict(temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
                  max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                  frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
                  repetition_penalties=torch.ones(rows), output_token_ids=[[] for _ in range(rows)],
                  allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=_processors())
    fields.update(changes)
    return SamplingMetadata(**fields)


def _logits(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, n, generator=g) * 4
    x[1] = 0.5  # all equal: index 0
    x[2, n // 3] = x[2, n - 2] = x[2].abs().max() + 1  # a tie: the first one
    x[3, n // 2] = float("inf")
    x[4, n - 1] = float("nan")  # a NaN: vLLM's argmax returns it
    x[5, 7] = -float("inf")
    return x.to(dtype)


def _sampler():
    from vllm.v1.sample.sampler import Sampler

    return Sampler()


def _stock_forward():
    from vllm.v1.sample.sampler import Sampler

    forward = Sampler.forward
    return forward.__wrapped__ if getattr(forward, patch.MARKER, False) else forward


def _ours(sampler, logits, metadata):
    return patch._make(_stock_forward())(sampler, logits, metadata)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [9, 4099, 49152])
def test_an_all_greedy_step_samples_what_vllms_sampler_samples(dtype, n):
    sampler, logits, metadata = _sampler(), _logits(n, dtype, n), _metadata(6)
    before = patch.taken["steps"]
    ours = _ours(sampler, logits.clone(), metadata)
    stock = _stock_forward()(sampler, logits.clone(), metadata)
    assert patch.taken["steps"] == before + 1
    assert ours.sampled_token_ids.dtype == stock.sampled_token_ids.dtype == torch.int32
    assert ours.sampled_token_ids.shape == stock.sampled_token_ids.shape == (6, 1)
    assert torch.equal(ours.sampled_token_ids, stock.sampled_token_ids)
    assert ours.logprobs_tensors is None and stock.logprobs_tensors is None
    assert ours.sampled_token_ids[4, 0] == n - 1  # the NaN row, as vLLM's float32 argmax has it


def test_a_step_that_keeps_vllms_path_is_sampled_by_vllm():
    # Request 0's logit bias makes token 5 its greedy token: vLLM's path applies it.
    sampler, logits = _sampler(), _logits(64, torch.bfloat16, 3)
    metadata = _metadata(6, logitsprocs=_processors(bias=True))
    before = patch.taken["steps"]
    out = _ours(sampler, logits, metadata)
    assert patch.taken["steps"] == before
    assert out.sampled_token_ids[0, 0] == 5


class _Holder:
    def __init__(self, tracked):
        self.tracked = tracked

    def has_tracked_requests(self):
        return self.tracked


@pytest.mark.parametrize("case,changes,bonus,logits,expected", [
    ("all greedy, built-in processors idle", {}, False, None, True),
    ("an idle thinking budget", {"thinking_budget_state_holder": _Holder(False)}, False, None, True),
    ("a sampled request", {"all_greedy": False}, False, None, False),
    ("sampled logprobs", {"max_num_logprobs": 0}, False, None, False),
    ("logprobs of given tokens", {"logprob_token_ids": {0: [3]}}, False, None, False),
    ("an allowed-token mask", {"allowed_token_ids_mask": torch.zeros(6, 64, dtype=torch.bool)}, False, None, False),
    ("bad words", {"bad_words_token_ids": {0: [[3]]}}, False, None, False),
    ("penalties", {"no_penalties": False}, False, None, False),
    ("a tracked thinking budget", {"thinking_budget_state_holder": _Holder(True)}, False, None, False),
    ("an active logit bias", {"logitsprocs": "bias"}, False, None, False),
    ("an active minimum of tokens", {"logitsprocs": "min_tokens"}, False, None, False),
    ("a processor of unknown state", {"logitsprocs": "other"}, False, None, False),
    ("a speculative bonus token", {}, True, None, False),
    ("one-dimensional logits", {}, False, torch.zeros(64), False),
    ("integer logits", {}, False, torch.zeros(6, 64, dtype=torch.int32), False),
])
def test_which_steps_take_one_argmax(case, changes, bonus, logits, expected):
    if isinstance(changes.get("logitsprocs"), str):
        changes = {"logitsprocs": _processors(**{changes["logitsprocs"]: True})}
    logits = torch.zeros(6, 64, dtype=torch.bfloat16) if logits is None else logits
    assert patch.qualifies(logits, _metadata(6, **changes), bonus) is expected, case


def test_applying_twice_wraps_once():
    from vllm.v1.sample import sampler

    patch._wrap(sampler)
    wrapped = sampler.Sampler.forward
    patch._wrap(sampler)
    assert sampler.Sampler.forward is wrapped and patch.in_force()


PROBE = (
    "import json, sys\n"
    "from vllm import LLM, SamplingParams\n"
    "from vllm_omni_edge.patches.worker import greedy_sampler as g\n"
    "llm = LLM(model=sys.argv[1], max_model_len=512, kv_cache_memory_bytes=64 << 20)\n"
    "prompts = ['The capital of France is', 'Write a short poem about the sea.', 'def fibonacci(n):']\n"
    "greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)\n"
    "outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]\n"
    "steps = g.taken['steps']\n"
    "# Logprobs and a logit bias keep vLLM's sampler: no step of this request takes one argmax.\n"
    "other = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, logit_bias={13: 5.0})\n"
    "biased = list(llm.generate(prompts[:1], other, use_tqdm=False)[0].outputs[0].token_ids)\n"
    "print('PROBE-RESULT ' + json.dumps({'outs': outs, 'steps': steps, 'after': g.taken['steps'],\n"
    "      'biased': biased, 'in_force': g.in_force()}))\n"
)


@pytest.mark.e2e
def test_the_default_model_decodes_the_same_greedy_tokens_with_one_argmax():
    from vllm_omni_edge.models.default_model import DEFAULT_MODEL, pull_cpu_int4_model

    model = str(pull_cpu_int4_model(DEFAULT_MODEL))
    ours = run_script_probe(PROBE, model, VLLM_OMNI_EDGE_GREEDY_SAMPLER="1")
    vllm = run_script_probe(PROBE, model, VLLM_OMNI_EDGE_GREEDY_SAMPLER="0")
    assert ours["in_force"] and not vllm["in_force"]
    assert ours["steps"] >= 24 and vllm["steps"] == 0, (ours["steps"], vllm["steps"])
    assert ours["after"] == ours["steps"]  # the biased request with logprobs took vLLM's sampler
    assert ours["outs"] == vllm["outs"]
    assert ours["biased"] == vllm["biased"]
    assert all(len(o) == 24 for o in ours["outs"])
