"""One pass of one arm on vLLM, in a fresh process.

    python -m vllm_omni_edge_bench.harness.pass_vllm --spec spec.json --out result.json

A fresh process per pass, so no pass inherits another's caches, compiled graphs
or allocator state. Everything vLLM-specific happens under ``__main__``: vLLM
spawns its engine and worker as new interpreters that import this module again.

Timing is wall clock (``time.perf_counter``) around ``LLM.generate``, because
``RequestOutput.metrics`` is None unless log stats are enabled, and enabling
them would change the arm. When an arm enables them, engine-side figures are
recorded as well, each figure saying which source it came from.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from vllm_omni_edge_bench.harness import pass_events
from vllm_omni_edge_bench.harness.pass_common import figure as _figure
from vllm_omni_edge_bench.harness.pass_common import run_workloads, start_up_figures, start_up_timings
from vllm_omni_edge_bench.harness.pass_common import pass_main, timed_workload, user_command_notes
from vllm_omni_edge_bench.harness.prompts import PromptBank

ENGINE_DECODE = "engine timestamps: (n-1) / (last_token_ts - first_token_ts)"
FIRST_SAMPLED = "wall clock: one request, temperature 1, one token out, right after the first (greedy) request"
VLLM_IMPORT = "wall clock: pass process creation (psutil) to `from vllm import LLM` done"


class Pass:
    """Runs the workloads of one spec against one LLM and records what came back."""

    def __init__(self, llm):
        self.llm = llm
        self.bank = PromptBank.from_tokenizer(llm.get_tokenizer())
        self.problems: list[str] = []

    def generate(self, prompt_tokens: int, max_tokens: int, purpose: str,
                 temperature: float = 0.0) -> dict[str, Any]:
        from vllm import SamplingParams

        ids = self.bank.take(prompt_tokens)
        # Greedy (unless asked) and ignore_eos: every arm generates exactly max_tokens tokens.
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        output = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        record = {
            "purpose": purpose,
            "seconds": seconds,
            "prompt_tokens": len(output.prompt_token_ids),
            "gen_tokens": len(output.outputs[0].token_ids),
            "cached_tokens": output.num_cached_tokens,
            "finish_reason": output.outputs[0].finish_reason,
            "engine": _engine_times(output.metrics),
        }
        if record["prompt_tokens"] != prompt_tokens or record["gen_tokens"] != max_tokens:
            self.problems.append(
                f"{purpose}: asked for {prompt_tokens}+{max_tokens} tokens, "
                f"got {record['prompt_tokens']}+{record['gen_tokens']} ({record['finish_reason']})"
            )
        if record["cached_tokens"]:
            self.problems.append(f"{purpose}: {record['cached_tokens']} prompt tokens came from the prefix cache")
        return record

    def first_token(self) -> dict[str, Any]:
        return self.generate(8, 1, "first request")

    def first_sampled(self) -> dict[str, Any]:
        """The first request that samples (temperature 1, the OpenAI default): vLLM's
        sampler has its own first-call costs, which a greedy first request does not see."""
        return self.generate(8, 1, "first sampled request", temperature=1.0)

    def run(self, workload: dict[str, Any]) -> dict[str, Any]:
        kind, label = workload["kind"], workload["label"]
        requests, figures = [], {}
        if kind in ("decode", "prefill", "ttft"):
            requests, figures, full = timed_workload(workload, self.generate, self.problems)
            engine = full["engine"] if full else None
            if engine and engine["decode_s"] > 0:
                figures[f"{label} (engine)"] = _figure(
                    (full["gen_tokens"] - 1) / engine["decode_s"], "tok/s", "higher", ENGINE_DECODE
                )
        elif kind == "cold_start":
            pass  # figures come from the timings of the first request, see run_pass()
        elif kind == "fidelity":
            from vllm_omni_edge_bench.harness import fidelity

            outcome = fidelity.run_vllm_workload(self.llm, workload)
            figures.update(outcome["figures"])
            self.problems += outcome["problems"]
            return {"kind": kind, "label": label, "params": workload, "figures": figures,
                    "requests": requests,
                    "fidelity": {"result": outcome["result"], "reference_key": outcome["reference_key"]}}
        else:
            raise NotImplementedError(f"workload {kind!r} is not implemented for vLLM passes yet")
        return {"kind": kind, "label": label, "params": workload, "figures": figures, "requests": requests}


def _engine_times(metrics) -> dict[str, float] | None:
    """Engine-core timestamps when vLLM kept them (log stats on), else None."""
    if metrics is None or not getattr(metrics, "first_token_ts", 0):
        return None
    return {
        "queued_to_first_token_s": metrics.first_token_ts - (metrics.scheduled_ts or metrics.first_token_ts),
        "decode_s": metrics.last_token_ts - metrics.first_token_ts,
    }


def _frontend_config(llm) -> dict[str, Any]:
    """What the front end resolved from the arm's kwargs (not proof the worker used it)."""
    wanted = {
        "kv_cache_memory_bytes": "cache_config.kv_cache_memory_bytes",
        "block_size": "cache_config.block_size",
        "enable_prefix_caching": "cache_config.enable_prefix_caching",
        "max_model_len": "model_config.max_model_len",
        "dtype": "model_config.dtype",
        "enforce_eager": "model_config.enforce_eager",
        "compilation_mode": "compilation_config.mode",
        "quantization": "model_config.quantization",
    }
    found: dict[str, Any] = {}
    config = llm.llm_engine.vllm_config
    for name, path in wanted.items():
        node = config
        try:
            for part in path.split("."):
                node = getattr(node, part)
        except AttributeError:
            node = "<absent>"
        found[name] = node if isinstance(node, (int, float, bool, str, type(None))) else str(node)
    return found


# Arm kwargs the front end must keep as given; e.g. VLLM_CPU_KVCACHE_SPACE silently
# replaces kv_cache_memory_bytes there.
KEPT_AS_GIVEN = ("kv_cache_memory_bytes", "max_model_len", "enforce_eager", "block_size", "enable_prefix_caching")


def discarded_settings(llm_kwargs: dict[str, Any], resolved: dict[str, Any]) -> list[str]:
    return [
        f"front end resolved {key}={resolved[key]!r}, the arm asked for {llm_kwargs[key]!r}"
        for key in KEPT_AS_GIVEN
        if key in llm_kwargs and key in resolved and resolved[key] != llm_kwargs[key]
    ]


def llm_arguments(spec: dict[str, Any]) -> dict[str, Any]:
    """All the pass gives vllm.LLM(...): the arm's model and llm_kwargs, nothing more. The pass sets
    no environment variable, thread count or seed either, so a user_command arm is measured as is."""
    return {"model": spec["model"], **spec["llm_kwargs"]}


def llm_command(arguments: dict[str, Any]) -> str:
    """The constructor call as a person would write it: ``LLM(model='/path', max_model_len=512)``."""
    return "LLM(" + ", ".join(f"{key}={value!r}" for key, value in arguments.items()) + ")"


def _versions() -> dict[str, Any]:
    import torch
    import vllm

    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": sys.version.split()[0],
    }


def run_pass(spec: dict[str, Any]) -> dict[str, Any]:
    import psutil

    events = spec["events_path"]
    pass_events.emit(events, pass_events.STARTED)
    process_start = psutil.Process().create_time()
    environ = dict(os.environ)  # before vLLM and the plugin set variables of their own here

    from vllm import LLM

    vllm_imported = time.time()
    constructor_start = time.perf_counter()
    arguments = llm_arguments(spec)
    llm = LLM(**arguments)
    load_s = time.perf_counter() - constructor_start
    pass_events.emit(events, pass_events.ENGINE_READY)

    runner = Pass(llm)
    frontend = _frontend_config(llm)
    runner.problems += discarded_settings(spec["llm_kwargs"], frontend)
    first = runner.first_token()
    first_token_t = pass_events.emit(events, pass_events.FIRST_TOKEN)
    timings = start_up_timings(process_start, first_token_t, load_s, first["seconds"])
    sampled = runner.first_sampled()
    timings["first_sampled_request_s"] = sampled["seconds"]
    timings["vllm_imported_s"] = vllm_imported - process_start

    start_up = start_up_figures(timings, "load", load_s, "wall clock: vllm.LLM(...) constructor")
    start_up["first sampled request"] = _figure(sampled["seconds"], "s", "lower", FIRST_SAMPLED)
    start_up["vllm import"] = _figure(timings["vllm_imported_s"], "s", "lower", VLLM_IMPORT)
    workloads = run_workloads(spec["workloads"], runner.run, start_up)
    pass_events.emit(events, pass_events.WORKLOADS_DONE)
    # Stop the engine core and workers now, not at interpreter exit (pass_main leaves with os._exit).
    llm.llm_engine.engine_core.shutdown()

    return {
        "engine": "vllm",
        "arm": spec["arm"],
        "pass_index": spec["pass_index"],
        "pid": os.getpid(),
        "model": spec["model"],
        "llm_kwargs": spec["llm_kwargs"],
        "command": llm_command(arguments),
        "notes": user_command_notes(environ) if spec.get("user_command") else [],
        "frontend_config": frontend,
        "versions": _versions(),
        "timings": timings,
        "first_request": first,
        "first_sampled_request": sampled,
        "workloads": workloads,
        "problems": runner.problems,
    }


def main(argv: list[str] | None = None) -> int:
    return pass_main(run_pass, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
