"""The compile progress patch: a line while vLLM compiles the model, closed however it ends."""

from __future__ import annotations

import types

import pytest

from vllm_omni_edge.patches.worker import compile_progress

torch_inductor = pytest.importorskip("torch._inductor.async_compile")


class Bars:
    """Stands in for tqdm: records each line's last count and whether it was closed."""

    def __init__(self):
        self.made = []

    def __call__(self, **kwargs):
        bar = types.SimpleNamespace(n=kwargs.get("initial", 0), closed=False)
        bar.update = lambda k: setattr(bar, "n", bar.n + k)
        bar.__enter__ = lambda: bar
        self.made.append(bar)
        return _Context(bar)


class _Context:
    def __init__(self, bar):
        self.bar = bar

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc):
        self.bar.closed = True


@pytest.fixture
def bars(monkeypatch):
    made = Bars()
    import tqdm

    monkeypatch.setattr(tqdm, "tqdm", made)
    monkeypatch.setattr(compile_progress, "SHOW_AFTER_S", 0.0)
    monkeypatch.setattr(compile_progress, "REFRESH_S", 0.01)
    # Inductor's own method would compile C++; the counter wraps whatever is there.
    monkeypatch.setattr(torch_inductor.AsyncCompile, "cpp_pybinding", lambda self, argtypes, source: source)
    return made


def fake_wrapper_module(body):
    class TorchCompileWithNoGuardsWrapper:
        def aot_compile(self, *args, **kwargs):
            return body(*args, **kwargs)

    return types.SimpleNamespace(TorchCompileWithNoGuardsWrapper=TorchCompileWithNoGuardsWrapper)


def hand_kernels_to_inductor(n: int) -> None:
    AsyncCompile = torch_inductor.AsyncCompile
    for _ in range(n):
        AsyncCompile.cpp_pybinding(AsyncCompile.__new__(AsyncCompile), [], "source")


def test_the_line_counts_kernels_handed_to_inductor_and_closes(bars):
    module = fake_wrapper_module(lambda: (hand_kernels_to_inductor(3), "compiled")[1])
    compile_progress._wrap(module)
    assert module.TorchCompileWithNoGuardsWrapper().aot_compile() == "compiled"
    assert len(bars.made) == 1 and bars.made[0].n == 3 and bars.made[0].closed


def test_an_error_closes_the_line_propagates_and_puts_the_counter_back(bars):
    before = torch_inductor.AsyncCompile.__dict__["cpp_pybinding"]

    def failing():
        raise RuntimeError("inductor failed")

    module = fake_wrapper_module(failing)
    compile_progress._wrap(module)
    with pytest.raises(RuntimeError, match="inductor failed"):
        module.TorchCompileWithNoGuardsWrapper().aot_compile()
    assert all(bar.closed for bar in bars.made)
    assert torch_inductor.AsyncCompile.__dict__["cpp_pybinding"] is before


def test_a_quick_call_shows_nothing(bars, monkeypatch):
    monkeypatch.setattr(compile_progress, "SHOW_AFTER_S", 60.0)
    module = fake_wrapper_module(lambda: "loaded")
    compile_progress._wrap(module)
    assert module.TorchCompileWithNoGuardsWrapper().aot_compile() == "loaded"
    assert bars.made == []


def test_wrapping_twice_wraps_once():
    module = fake_wrapper_module(lambda: None)
    compile_progress._wrap(module)
    first = module.TorchCompileWithNoGuardsWrapper.aot_compile
    compile_progress._wrap(module)
    assert module.TorchCompileWithNoGuardsWrapper.aot_compile is first
