"""A compiled forward called with its kept argument list gives what dynamo's own path gives,
and only calls the plan explains skip that path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.e2e.probe import run_script_probe
from vllm_omni_edge.patches.worker import compiled_graph_args as patch
from vllm_omni_edge.patches.worker.compiled_graph_args import Observation, Unexplained


class Name:
    """Stands for vLLM's LayerName: a new object every call, equal by value."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Name) and other.value == self.value

    def __hash__(self):
        return hash(self.value)


def _observation(weight, n, *, layer=True, extra=None):
    x, pos = torch.randn(n, 4), torch.arange(n)
    flat = [n, x, weight, pos] + ([Name("layers.0.attn")] if layer else []) + ([extra] if extra is not None else [])
    out = (torch.zeros(n), torch.ones(n))
    return Observation(args=(x, pos, None), flat=tuple(flat), outputs=out, result=out[1])


def test_classify_sorts_every_kind_of_argument():
    weight = torch.randn(4, 4)
    watched = [_observation(weight, 5), _observation(weight, 1)]
    slots = patch.classify(watched)
    assert [s[0] for s in slots] == ["size", "input", "static", "input", "static"]
    assert slots[0] == ("size", 0, 0) and slots[1] == ("input", 0) and slots[3] == ("input", 1)
    assert slots[2][1] is weight and slots[4][1] == Name("layers.0.attn")
    assert patch.result_map(watched) == ("item", 1)
    # The plan rebuilds a new call's arguments exactly.
    fresh = _observation(weight, 3)
    assert patch.matches(slots, ("item", 1), fresh)
    built = patch.build(slots, fresh.args)
    assert built[0] == 3 and built[1] is fresh.args[0] and built[2] is weight and built[3] is fresh.args[1]
    template, per_call = patch.compile_plan(slots)
    assert template[2] is weight and template[4] == Name("layers.0.attn")
    assert per_call == ((0, 0, 0), (1, 0, None), (3, 1, None))


def test_a_changed_parameter_is_not_explained_by_the_plan():
    weight = torch.randn(4, 4)
    slots = patch.classify([_observation(weight, 5), _observation(weight, 1)])
    assert not patch.matches(slots, ("item", 1), _observation(torch.randn(4, 4), 2))


@pytest.mark.parametrize("case", ["tensor", "integer", "same-sizes", "other-object", "result"])
def test_what_the_plan_cannot_explain_raises(case):
    weight = torch.randn(4, 4)
    if case == "tensor":  # a tensor that is neither kept nor one of forward's arguments
        watched = [_observation(weight, 5, extra=torch.zeros(2)), _observation(weight, 1, extra=torch.zeros(2))]
    elif case == "integer":  # an integer that changes but is no input's size
        watched = [_observation(weight, 5, extra=7), _observation(weight, 1, extra=8)]
    elif case == "same-sizes":  # the sizes never varied: a size cannot be told from a constant
        watched = [_observation(weight, 2), _observation(weight, 2)]
    elif case == "other-object":
        watched = [_observation(weight, 5, extra=Name("a")), _observation(weight, 1, extra=Name("b"))]
    else:
        watched = [_observation(weight, 5), _observation(weight, 1)]
        watched[1] = Observation(watched[1].args, watched[1].flat, watched[1].outputs, torch.zeros(1))
    with pytest.raises(Unexplained):
        patch.classify(watched)
        patch.result_map(watched)


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x, pos):
        return self.b(self.a(x).relu() + pos[:, None])


@pytest.fixture(scope="module")
def compiled():
    """A real ahead-of-time compiled function, guards off, as vLLM loads one from its cache."""
    module = Small().eval()
    x, pos = torch.randn(3, 8), torch.arange(3.0)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    fn = torch.compile(Small.forward, fullgraph=True, dynamic=False).aot_compile(((module, x, pos), {}))
    fn.disable_guard_check()
    return module, fn


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.arange(float(n))


def test_a_real_compiled_function_goes_direct_after_its_checks(compiled, monkeypatch):
    module, fn = compiled
    told = []
    monkeypatch.setattr(patch, "listeners", [told.append])
    original = getattr(type(fn).__call__, "__wrapped__", type(fn).__call__)
    dynamo_calls = []

    def counted(self, *args, **kwargs):
        dynamo_calls.append(1)
        return original(self, *args, **kwargs)

    memo = patch.Memo(fn)
    assert memo.name is not None
    with torch.no_grad():
        for i, n in enumerate([3, 1, 2, 5]):  # two watched (sizes differ), two checked
            x, pos = _inputs(n, i)
            torch.testing.assert_close(memo(counted, (module, x, pos), {}), original(fn, module, x, pos))
        assert memo.states[memo.pattern((module, x, pos), {})][0] == "plan"
        assert told and told[-1]["planned"] >= 1  # the evidence hears of the plan
        before = len(dynamo_calls)
        for n in (1, 7, 4):
            x, pos = _inputs(n, 10 + n)
            got = memo(counted, (module, x, pos), {})
            torch.testing.assert_close(got, module(x, pos))
        assert len(dynamo_calls) == before  # the planned calls did not go through dynamo's code


def test_a_parameter_replaced_during_the_checks_turns_the_plan_off(compiled):
    module, fn = compiled
    original = getattr(type(fn).__call__, "__wrapped__", type(fn).__call__)
    memo = patch.Memo(fn)
    kept = module.a.weight
    try:
        with torch.no_grad():
            for i, n in enumerate([3, 1]):
                memo(original, (module, *_inputs(n, i)), {})
            module.a.weight = torch.nn.Parameter(torch.randn(8, 8))
            x, pos = _inputs(2, 9)
            torch.testing.assert_close(memo(original, (module, x, pos), {}), module(x, pos))
        assert memo.states[memo.pattern((module, x, pos), {})][0] == "off"
    finally:
        module.a.weight = kept


def test_forget_plans_watches_again_after_weights_reload(compiled):
    module, fn = compiled
    original = getattr(type(fn).__call__, "__wrapped__", type(fn).__call__)
    memo = patch.memo_of(fn)
    with torch.no_grad():
        for i, n in enumerate([3, 1, 2, 5]):
            memo(original, (module, *_inputs(n, i)), {})
    assert any(s[0] == "plan" for s in memo.states.values())
    runner = SimpleNamespace(reloaded=0)

    def reload_weights(self):
        self.reloaded += 1

    patch.make_reload_wrapper(reload_weights)(runner)
    assert runner.reloaded == 1 and memo.states == {}


def test_wrapped_once():
    owner = type("AOTCompiledFunction", (), {"__call__": lambda self: None})
    module = SimpleNamespace(AOTCompiledFunction=owner)
    patch._wrap(module)
    first = owner.__call__
    patch._wrap(module)
    assert owner.__call__ is first and first.__wrapped__ is not first


def test_code_with_side_effects_has_no_graph_to_call():
    def stores(self):
        self.x = 1

    assert patch.graph_name(stores) is None
    assert patch.graph_name(lambda: None) is None


def test_with_guards_on_a_planned_call_checks_them_first(compiled):
    module, fn = compiled
    original = getattr(type(fn).__call__, "__wrapped__", type(fn).__call__)
    memo = patch.Memo(fn)
    checks, dynamo = [], []

    def counted(self, *args, **kwargs):
        dynamo.append(1)
        return original(self, *args, **kwargs)

    fn._guard_check_enabled = True
    try:
        with torch.enable_grad():  # the grad mode it was compiled in, sizes >= 2: the real guards pass
            for i, n in enumerate([3, 2, 4, 5]):
                memo(counted, (module, *_inputs(n, i)), {})
            fn.guard_check = lambda *a, **k: checks.append(1) or True
            before = len(dynamo)
            x, pos = _inputs(4, 20)
            torch.testing.assert_close(memo(counted, (module, x, pos), {}), module(x, pos))
            assert checks == [1] and len(dynamo) == before  # checked, then the kept list
            fn.guard_check = lambda *a, **k: False
            with pytest.raises(RuntimeError):  # a failing guard goes to dynamo's path, which raises
                memo(counted, (module, x, pos), {})
    finally:
        fn._guard_check_enabled = False
        fn.__dict__.pop("guard_check", None)


PROBE = (
    "import json, sys\n"
    "from vllm import LLM, SamplingParams\n"
    "from vllm_omni_edge.patches.worker import compiled_graph_args as m\n"
    "llm = LLM(model=sys.argv[1], max_model_len=512)\n"
    "sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)\n"
    "prompt = ['Write a short story about a lighthouse keeper.']\n"
    "planned = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids\n"
    "states = sorted(s[0] for memo in m._MEMOS for s in memo.states.values())\n"
    "guards = any(memo.compiled._guard_check_enabled for memo in m._MEMOS)\n"
    "kept = m.Memo.__call__\n"
    "m.Memo.__call__ = lambda self, original, args, kwargs: original(self.compiled, *args, **kwargs)\n"
    "dynamo = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids\n"
    "print('PROBE-RESULT ' + json.dumps({'planned': list(planned), 'dynamo': list(dynamo), 'states': states,"
    " 'guards': guards}))\n"
)


@pytest.mark.e2e
def test_the_default_model_decodes_the_same_tokens_from_the_kept_arguments():
    from vllm_omni_edge.models.default_model import DEFAULT_MODEL, pull_cpu_int4_model

    model = pull_cpu_int4_model(DEFAULT_MODEL)
    # Decode steps through the compiled forward: the decoder stack would take them.
    result = run_script_probe(PROBE, str(model), VLLM_OMNI_EDGE_DECODER_STACK="0")
    # A start that compiled (guards on) plans as well as one that loaded the cache (guards off).
    assert "plan" in result["states"], result
    assert result["planned"] == result["dynamo"]
