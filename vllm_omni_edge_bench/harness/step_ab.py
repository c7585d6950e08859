"""A decode-step lever against its off arm, step by step in one engine.

    python -m vllm_omni_edge_bench.harness.step_ab --levers compiled_graph_args,slot_mapping_call
        [--model default:cpu_int4] [--llm-kwargs '{"max_model_len": 512}'] [--rounds 8]
        [--gen-tokens 128] [--prompt-tokens N] [--out DIR]

Builds ``LLM(model=CKPT, **llm_kwargs)`` in this process as the user's command does (no
environment flags: every lever in its default state) and decodes greedy requests of
``--gen-tokens`` tokens. During each request the named levers are switched off and on again
at alternate engine steps (the harness swaps the patched callables for vLLM's and back, see
``LEVERS``), and each step's wall time goes to its arm. A lever's effect of a few percent is
well below what the box's bandwidth does between two processes minutes apart; here both arms
see the same box within milliseconds. The first two steps of a request (its prefill and the
plan's first calls) are not counted.

Per round (one request): each arm's median step. Reported: the off/on ratio of those medians
over the rounds (median, min–max; above 1 means the lever shortens a step), and each arm's
median step. Every request's tokens must equal a first request's with the levers on, and each
lever must show it acted (``acted``), or the run fails. One run on a shared box is an
observation: quote it with its box and spread.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vllm_omni_edge_bench.harness import engine_probe
from vllm_omni_edge_bench.harness.runner import RESULTS_ROOT
from vllm_omni_edge_bench.harness.stats import spread

PROMPT = "Write a story about a cat."
SKIP_STEPS = 2


class StepABError(RuntimeError):
    """The run cannot measure what it claims to."""


@dataclass
class Lever:
    """How to switch a patch off and on while the engine runs, and how to tell it acted."""

    off: Callable[[], None]
    on: Callable[[], None]
    acted: Callable[[], bool]


def _graph_args() -> Lever:
    from vllm_omni_edge.patches.worker import compiled_graph_args as patch

    engine_probe.without_decoder_stack()

    planned = patch.Memo.__call__

    def bypass(self, original, args, kwargs):
        return original(self.compiled, *args, **kwargs)

    def off():
        patch.Memo.__call__ = bypass

    def on():
        patch.Memo.__call__ = planned

    return Lever(off, on, lambda: patch.summary()["planned"] > 0)


def _slot_mapping() -> Lever:
    from vllm.v1.worker import block_table

    wrapped = block_table.BlockTable.compute_slot_mapping
    if not getattr(wrapped, "__edge_slot_mapping_call__", False):
        raise StepABError("slot_mapping_call is not applied in this process")
    stock = wrapped.__wrapped__

    def off():
        block_table.BlockTable.compute_slot_mapping = stock

    def on():
        block_table.BlockTable.compute_slot_mapping = wrapped

    return Lever(off, on, lambda: True)


def _decode_attention() -> Lever:
    from vllm.v1.attention.backends import cpu_attn

    from vllm_omni_edge.patches.worker import cpu_attention_calls as patch

    if not patch.decode_in_force():
        raise StepABError("the decode attention op is not in force in this process")
    engine_probe.without_decoder_stack()
    impl = cpu_attn.CPUAttentionBackendImpl
    wrapped = impl.forward
    without = patch.forward_without_decode(cpu_attn)

    def off():
        impl.forward = without

    def on():
        impl.forward = wrapped

    return Lever(off, on, patch.decode_in_force)


def _sampler_argmax() -> Lever:
    from vllm.v1.sample import sampler

    from vllm_omni_edge.patches.worker import sampler_argmax as patch

    if not patch.in_force():
        raise StepABError("sampler_argmax is not applied in this process")
    ours = sampler.Sampler.__dict__["greedy_sample"]
    stock = staticmethod(ours.__func__.__wrapped__)

    def off():
        sampler.Sampler.greedy_sample = stock

    def on():
        sampler.Sampler.greedy_sample = ours

    return Lever(off, on, patch.in_force)


def _decode_prefetch() -> Lever:
    import torch

    from vllm_omni_edge.quantization.kernels.native import load_library

    loaded, why = load_library()
    if not loaded:
        raise StepABError(f"the kernel library is not loaded: {why}")
    distance = torch.ops.edge_cpu_int4.rows16_decode_prefetch
    counts = torch.ops.edge_cpu_int4.rows16_path_counts
    default = distance(0)  # reads the library's distance (and restores it below)
    distance(default)
    if default == 0:
        raise StepABError("the rows16 decode kernel's prefetch is already off in this process")
    tiles_before = counts()[0]

    return Lever(lambda: distance(0), lambda: distance(default), lambda: counts()[0] > tiles_before)


def _stack_step_inputs() -> Lever:
    from vllm.v1.worker import gpu_model_runner

    from vllm_omni_edge.patches.worker import stack_step_inputs as patch

    if not patch.in_force():
        raise StepABError("stack_step_inputs is not applied in this process")
    runner_cls = gpu_model_runner.GPUModelRunner
    wrapped = runner_cls.execute_model
    stock = wrapped.__wrapped__
    taken = []
    # The patch tells its listeners when a runner takes its first step that way.
    patch.listeners.append(taken.append)

    def off():
        runner_cls.execute_model = stock

    def on():
        runner_cls.execute_model = wrapped

    return Lever(off, on, lambda: bool(taken))


LEVERS: dict[str, Callable[[], Lever]] = {
    "compiled_graph_args": _graph_args,
    "slot_mapping_call": _slot_mapping,
    "decode_attention": _decode_attention,
    "sampler_argmax": _sampler_argmax,
    "decode_prefetch": _decode_prefetch,
    "stack_step_inputs": _stack_step_inputs,
}


def prompt_ids(tokenizer, tokens: int) -> list[int]:
    """PROMPT's tokens repeated to ``tokens`` (a decode at depth: each step attends over them)."""
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    return (ids * (tokens // len(ids) + 1))[:tokens]


def run(model: str, llm_kwargs: dict[str, Any], names: list[str], rounds: int, gen_tokens: int,
        prompt_tokens: int | None = None) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, **llm_kwargs)
    core = engine_probe.in_process_core(llm, StepABError, "the levers must switch in the process that runs the model")
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True, temperature=0)
    prompt = PROMPT if prompt_tokens is None else {"prompt_token_ids": prompt_ids(llm.get_tokenizer(), prompt_tokens)}
    # Built before the reference request: a lever may set how every step of the run computes.
    levers = [LEVERS[name]() for name in names]
    reference = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    steps: dict[str, list[float]] = {"on": [], "off": []}
    state = {"n": 0}
    step_fn = core.step_fn

    def alternating(*args, **kwargs):
        state["n"] += 1
        arm = "off" if state["n"] % 2 else "on"
        for lever in levers:
            (lever.off if arm == "off" else lever.on)()
        start = time.perf_counter()
        try:
            return step_fn(*args, **kwargs)
        finally:
            if state["n"] > SKIP_STEPS:
                steps[arm].append(time.perf_counter() - start)

    core.step_fn = alternating
    per_round: list[dict[str, float]] = []
    try:
        for _ in range(rounds):
            state["n"] = 0
            steps["on"].clear()
            steps["off"].clear()
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            if list(out.token_ids) != reference:
                raise StepABError("a request's tokens differ from the first request's: the arms do not compute the same")
            on, off = spread(steps["on"])["median"] * 1e3, spread(steps["off"])["median"] * 1e3
            per_round.append({"on_ms": on, "off_ms": off, "ratio": off / on})
    finally:
        core.step_fn = step_fn
        for lever in levers:
            lever.on()
    not_acting = [name for name, lever in zip(names, levers) if not lever.acted()]
    if not_acting:
        raise StepABError(f"levers that never acted: {not_acting}")
    return {"model": model, "llm_kwargs": llm_kwargs, "levers": names, "rounds": rounds, "gen_tokens": gen_tokens,
            "prompt_tokens": prompt_tokens, "per_round": per_round,
            "step_ms": {arm: spread([r[f"{arm}_ms"] for r in per_round]) for arm in ("on", "off")},
            "off_over_on": spread([r["ratio"] for r in per_round])}


def render_markdown(record: dict[str, Any]) -> str:
    prov = record["provenance"]
    ratio = record["off_over_on"]
    lines = [f"# Step A/B: {', '.join(record['levers'])} on {record['model']}", "",
             "One run on a shared box: an observation, not a grid measurement.", "",
             f"- `LLM(model=..., {', '.join(f'{k}={v!r}' for k, v in record['llm_kwargs'].items())})`, "
             f"{record['gen_tokens']} greedy tokens a request"
             + (f" after a {record['prompt_tokens']}-token prompt" if record.get("prompt_tokens") else "")
             + f", {record['rounds']} requests; the levers "
             "off at odd engine steps, on at even ones",
             f"- CPU: {prov['cpu'].get('model_name')}, {prov['cpu'].get('logical_cpus')} logical CPUs; "
             f"code {(prov['git'].get('sha') or '?')[:12]}{' (dirty)' if prov['git'].get('dirty') else ''}", "",
             f"**Step off / on: {ratio['median']:.3f} ({ratio['min']:.3f}–{ratio['max']:.3f})**", "",
             "| request | step on, ms | step off, ms | off / on |", "|---:|---:|---:|---:|"]
    lines += [f"| {i + 1} | {r['on_ms']:.3f} | {r['off_ms']:.3f} | {r['ratio']:.3f} |"
              for i, r in enumerate(record["per_round"])]
    return "\n".join(lines) + "\n"


def default_out(model: str, names: list[str]) -> Path:
    name = Path(model.split(":")[0]).name.lower().replace("_", "-")
    return RESULTS_ROOT / f"{time.strftime('%Y-%m-%d')}-step-ab-{'-'.join(n.replace('_', '-') for n in names)}-{name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levers", required=True, help=f"comma-separated, of: {', '.join(LEVERS)}")
    engine_probe.add_arguments(parser, rounds=8, out_default="results/<date>-step-ab-<levers>-<model>")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="a prompt of this many tokens (the story prompt repeated) instead of the story prompt")
    args = parser.parse_args(argv)
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        parser.error(f"--prompt-tokens must be at least 1, got {args.prompt_tokens}")
    names = [n.strip() for n in args.levers.split(",") if n.strip()]
    unknown = [n for n in names if n not in LEVERS]
    if not names or unknown:
        parser.error(f"--levers: unknown {unknown or 'none given'}; known: {', '.join(LEVERS)}")
    model, llm_kwargs, out = engine_probe.parse(parser, args, lambda: default_out(args.model, names))
    record = engine_probe.record_start("vllm_omni_edge_bench.harness.step_ab", argv)
    try:
        record.update(run(model, llm_kwargs, names, args.rounds, args.gen_tokens, args.prompt_tokens))
    except StepABError as error:
        print(f"step_ab: {error}", file=sys.stderr)
        return 1
    engine_probe.save(out, "step_ab", record, render_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
