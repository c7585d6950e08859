"""Where a decode step's time goes, by subtraction: the same engine with parts of the forward stubbed.

    python -m vllm_omni_edge_bench.harness.decode_decompose [--model default:cpu_int4]
        [--llm-kwargs '{"max_model_len": 512}'] [--rounds 5] [--gen-tokens 128] [--out DIR]

Builds ``LLM(model=CKPT, **llm_kwargs)`` in this process as the user's command does (no
environment flags; the plugin's default one-process layout), with decode steps through vLLM's
compiled forward (the decoder stack, which would run them, switched off), and decodes greedy requests of
``--gen-tokens`` tokens. Four arms, interleaved round by round in the one engine:

- ``real``: nothing stubbed;
- ``attention-stubbed``: the compiled forward's attention op (``vllm::unified_attention_with_output``)
  returns at once;
- ``linears-stubbed``: the forward's cpu_int4 linear ops return a preallocated output of the
  right shape without reading a weight;
- ``both-stubbed``: both; what is left is the compiled graph's own work (its Python wrapper,
  the small fused kernels for norms, rope and residuals, the op dispatch).

A stub replaces an op overload's ``default`` attribute, which is what the compiled graph calls
on every step; the head runs outside the forward (``compute_logits``, called through the op
packet) and is never stubbed. Each stub counts its calls, and an arm whose stubs were not called
is an error: it would have measured nothing. Stubbed arms produce wrong tokens (that is the
point); the real arm's tokens must equal those of a first real request, or the run fails.

Per arm and round: the forward (``model.forward``), the head (``model.compute_logits``) and the
engine step (``EngineCore.step``), mean ms per decode step. Derived, from medians: the graph's
own time (both stubbed), attention (linears stubbed minus both), linear ops (attention stubbed
minus both), the rest of the forward (real minus those three: what the parts cost together
beyond their sum), and the step outside forward and head (runner, sampler, scheduler, output).
One run on a shared box is an observation: quote it with its box and spread.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from vllm_omni_edge_bench.harness import engine_probe
from vllm_omni_edge_bench.harness.runner import RESULTS_ROOT
from vllm_omni_edge_bench.harness.stats import spread

ATTENTION_OP = ("vllm", "unified_attention_with_output")
ATTENTION_KEY = "::".join(ATTENTION_OP)


def _rows_by(index: int) -> Callable[..., tuple[int, int]]:
    """Output shape [rows of x, rows of the weight at ``index``] (weights are [N, K/2])."""
    return lambda *args: (args[0].shape[0], args[index].shape[0])


# The cpu_int4 linear ops a compiled forward calls, and their output shapes.
LINEAR_OPS: dict[tuple[str, str], Callable[..., tuple[int, int]]] = {
    ("edge_cpu_int4", "w4a8_vnni_rows16_mm"): _rows_by(1),
    ("edge_cpu_int4", "w4a8_vnni_rows16_silu_mlp"): _rows_by(5),
    ("edge_cpu_int4", "w4a8_mm"): _rows_by(1),
    ("edge_cpu_int4", "w4a8_avx2_rows8_mm"): _rows_by(1),
}
ARMS = ("real", "attention-stubbed", "linears-stubbed", "both-stubbed")
PROMPT = "Write a story about a cat."


class DecomposeError(RuntimeError):
    """The run cannot measure what it claims to."""


class Stubs:
    """Swaps op overloads' ``default`` for counting stubs and back."""

    def __init__(self) -> None:
        import torch

        self.calls: Counter[str] = Counter()
        self.real: dict[str, Any] = {}
        self.fake: dict[str, Any] = {}
        self._outputs: dict[tuple, Any] = {}
        self._packets: dict[str, Any] = {}
        for namespace, name in [ATTENTION_OP, *LINEAR_OPS]:
            try:
                packet = getattr(getattr(torch.ops, namespace), name)
                overload = packet.default
            except (AttributeError, RuntimeError):
                continue  # not registered on this CPU (its kernel library is not built here)
            key = f"{namespace}::{name}"
            self._packets[key], self.real[key] = packet, overload
            self.fake[key] = self._attention_stub(key) if key == ATTENTION_KEY \
                else self._linear_stub(key, LINEAR_OPS[(namespace, name)])
        self._attention = [key for key in self.real if key == ATTENTION_KEY]
        self._linears = [key for key in self.real if key != ATTENTION_KEY]

    def _attention_stub(self, key: str):
        def stub(*args, **kwargs):
            self.calls[key] += 1
        return stub

    def _linear_stub(self, key: str, shape_of):
        import torch

        def stub(*args, **kwargs):
            self.calls[key] += 1
            x = args[0]
            shape = shape_of(*args)
            out = self._outputs.get((shape, x.dtype))
            if out is None:
                out = self._outputs[(shape, x.dtype)] = torch.zeros(shape, dtype=x.dtype)
            return out
        return stub

    def groups(self, arm: str) -> list[list[str]]:
        """The op groups an arm stubs: each must see calls (a CPU's linears use one of the ops)."""
        attention, linears = self._attention, self._linears
        return {"real": [], "attention-stubbed": [attention], "linears-stubbed": [linears],
                "both-stubbed": [attention, linears]}[arm]

    def keys(self, arm: str) -> list[str]:
        return [key for group in self.groups(arm) for key in group]

    def apply(self, arm: str) -> list[str]:
        stubbed = self.keys(arm)
        for key, packet in self._packets.items():
            packet.default = self.fake[key] if key in stubbed else self.real[key]
        return stubbed

    def restore(self) -> None:
        self.apply("real")


def derive(medians: dict[str, dict[str, float]]) -> dict[str, float]:
    """ms per step of each part, from the arms' median forward, head and step times."""
    forward = {arm: medians[arm]["forward_ms"] for arm in ARMS}
    graph = forward["both-stubbed"]
    attention = forward["linears-stubbed"] - graph
    linears = forward["attention-stubbed"] - graph
    real = medians["real"]
    return {
        "linear ops": linears,
        "attention op": attention,
        "graph's own work": graph,
        "forward, the parts together beyond their sum": forward["real"] - graph - attention - linears,
        "head (compute_logits)": real["head_ms"],
        "step outside forward and head": real["step_ms"] - real["forward_ms"] - real["head_ms"],
        "step": real["step_ms"],
    }


def run(model: str, llm_kwargs: dict[str, Any], rounds: int, gen_tokens: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, **llm_kwargs)
    core = engine_probe.in_process_core(llm, DecomposeError, "the stubs must be in the process that runs the model")
    # What it decomposes is vLLM's compiled forward.
    engine_probe.without_decoder_stack()
    runner = core.model_executor.driver_worker.worker.model_runner
    model_module = runner.model
    times: Counter[str] = Counter()

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] += time.perf_counter() - start
        return wrapper

    model_module.forward = timed("forward", model_module.forward)
    model_module.compute_logits = timed("head", model_module.compute_logits)
    step_fn = core.step_fn  # what the busy loop and LLM.generate call each step
    core.step_fn = timed("step", step_fn)
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True, temperature=0)
    reference = list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)
    stubs = Stubs()
    if ATTENTION_KEY not in stubs.real or len(stubs.real) < 2:
        raise DecomposeError(f"ops to stub not found: have {sorted(stubs.real)}")
    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    calls: dict[str, dict[str, int]] = {}
    try:
        for _ in range(rounds):
            for arm in ARMS:
                stubbed = stubs.apply(arm)
                stubs.calls.clear()
                times.clear()
                start = time.perf_counter()
                out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
                seconds = time.perf_counter() - start
                for group in stubs.groups(arm):
                    if not any(stubs.calls[key] for key in group):
                        raise DecomposeError(f"arm {arm}: the forward called none of {group}; nothing was stubbed")
                if arm == "real" and list(out.token_ids) != reference:
                    raise DecomposeError("the real arm's tokens differ from the first request's: "
                                         "a stub leaked into it")
                steps = len(out.token_ids)
                calls[arm] = {key: stubs.calls[key] // steps for key in stubbed if stubs.calls[key]}
                samples[arm].append({"forward_ms": times["forward"] / steps * 1e3,
                                     "head_ms": times["head"] / steps * 1e3,
                                     "step_ms": times["step"] / steps * 1e3,
                                     "tok_s": steps / seconds})
    finally:
        stubs.restore()
        core.step_fn = step_fn
    arms = {arm: {key: spread([s[key] for s in samples[arm]]) for key in samples[arm][0]} for arm in ARMS}
    medians = {arm: {key: value["median"] for key, value in figures.items()} for arm, figures in arms.items()}
    return {"model": model, "llm_kwargs": llm_kwargs, "rounds": rounds, "gen_tokens": gen_tokens,
            "stub_calls_per_step": calls, "arms": arms, "samples": samples, "parts_ms": derive(medians)}


def render_markdown(record: dict[str, Any]) -> str:
    prov = record["provenance"]
    lines = [f"# Decode decomposition: {record['model']}", "",
             "One run on a shared box: an observation, not a grid measurement.", "",
             f"- `LLM(model=..., {', '.join(f'{k}={v!r}' for k, v in record['llm_kwargs'].items())})`, "
             f"{record['gen_tokens']} greedy tokens a request, {record['rounds']} rounds of the four arms interleaved",
             f"- CPU: {prov['cpu'].get('model_name')}, {prov['cpu'].get('logical_cpus')} logical CPUs, "
             f"AMX {'yes' if prov['cpu'].get('kernel_flags', {}).get('amx_tile') else 'no'}; "
             f"code {(prov['git'].get('sha') or '?')[:12]}{' (dirty)' if prov['git'].get('dirty') else ''}",
             f"- stub calls a step: {json.dumps(record['stub_calls_per_step'])}", "",
             "| arm | forward ms | head ms | step ms | tok/s |", "|---|---:|---:|---:|---:|"]
    for arm, figures in record["arms"].items():
        cells = [f"{figures[k]['median']:.3f} ({figures[k]['min']:.3f}–{figures[k]['max']:.3f})"
                 for k in ("forward_ms", "head_ms", "step_ms")]
        tok = figures["tok_s"]
        lines.append(f"| {arm} | {' | '.join(cells)} | {tok['median']:.1f} ({tok['min']:.1f}–{tok['max']:.1f}) |")
    lines += ["", "| part of a decode step | ms (from medians) |", "|---|---:|"]
    lines += [f"| {part} | {ms:.3f} |" for part, ms in record["parts_ms"].items()]
    return "\n".join(lines) + "\n"


def default_out(model: str) -> Path:
    name = Path(model.split(":")[0]).name.lower().replace("_", "-")
    return RESULTS_ROOT / f"{time.strftime('%Y-%m-%d')}-decode-decompose-{name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_probe.add_arguments(parser, rounds=5, out_default="results/<date>-decode-decompose-<model>")
    args = parser.parse_args(argv)
    model, llm_kwargs, out = engine_probe.parse(parser, args, lambda: default_out(args.model))
    record = engine_probe.record_start("vllm_omni_edge_bench.harness.decode_decompose", argv)
    try:
        record.update(run(model, llm_kwargs, args.rounds, args.gen_tokens))
    except DecomposeError as error:
        print(f"decode_decompose: {error}", file=sys.stderr)
        return 1
    engine_probe.save(out, "decode_decompose", record, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
