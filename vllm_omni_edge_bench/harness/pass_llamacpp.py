"""One pass of one llama.cpp arm, in a fresh process: the same workloads as pass_vllm.

    python -m vllm_omni_edge_bench.harness.pass_llamacpp --spec spec.json --out result.json

Same definitions as the vLLM pass, so the two engines' figures are comparable:
prompts are the same PromptBank token ids (made from the arm's HF tokenizer in
the harness process by :func:`prepare_spec`), generation is greedy and produces
exactly the asked number of tokens (the loop ignores EOS), decode is
``(n-1) / (t(n tokens) - t(1 token))`` at the same prompt length, prefill and
TTFT are one request with one token out, cold start is process creation to the
first token. Each request starts on an empty KV cache (no prefix reuse).

The pass imports neither torch nor transformers, so the memory ledger sees
llama.cpp alone. It writes llama.cpp's evidence (buffer types, threads, mmap,
compiled CPU features) as ``worker-<pid>.json`` in the evidence directory, where
the runner checks the arm's ``expect`` against it exactly as for a vLLM worker.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from vllm_omni_edge_bench.harness import pass_events
from vllm_omni_edge_bench.harness.pass_common import figure as _figure
from vllm_omni_edge_bench.harness.pass_common import run_workloads, start_up_figures, start_up_timings
from vllm_omni_edge_bench.harness.pass_common import pass_main, timed_workload
from vllm_omni_edge_bench.harness.prompts import FIXED_TEXT, PromptBank

EVIDENCE_ENV = "VLLM_OMNI_EDGE_EVIDENCE_DIR"
ENGINE_DECODE = "llama.cpp perf counters: n_eval / t_eval of the n-token request"


# ---------------------------------------------------------------------------
# In the harness process


_tokenizers: dict[str, Any] = {}
_fidelity_inputs: dict[str, dict[str, Any]] = {}


def _tokenizer(path: str):
    if path not in _tokenizers:
        from transformers import AutoTokenizer

        _tokenizers[path] = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return _tokenizers[path]


def prepare_spec(spec: dict[str, Any], arm) -> dict[str, Any]:
    """Add what the pass needs but must not compute itself (it would load transformers and torch).

    - ``llamacpp``: the arm's settings;
    - ``prompt_token_ids``: the fixed text encoded by the arm's tokenizer (what PromptBank cuts prompts from),
      and ``prompt_text``: those ids decoded again, for the pass to check llama.cpp reads them the same;
    - ``fidelity``: per fidelity workload label, :func:`fidelity.prepared_inputs` (windows, reference key).
    """
    from vllm_omni_edge_bench.harness.grid import resolve_model

    settings = arm.llamacpp.model_dump()
    tokenizer_path = resolve_model(settings["tokenizer"])
    tokenizer = _tokenizer(tokenizer_path)
    ids = [int(i) for i in tokenizer.encode(FIXED_TEXT, add_special_tokens=False)]
    fidelity = {}
    for workload in spec["workloads"]:
        if workload["kind"] == "fidelity":
            from vllm_omni_edge_bench.harness import fidelity as fid

            cache_key = json.dumps(workload, sort_keys=True)
            if cache_key not in _fidelity_inputs:
                _fidelity_inputs[cache_key] = fid.prepared_inputs(workload)
            fidelity[workload["label"]] = _fidelity_inputs[cache_key]
    return {**spec, "llamacpp": settings, "tokenizer_path": tokenizer_path, "prompt_token_ids": ids,
            "prompt_text": tokenizer.decode(ids), "fidelity": fidelity}


# ---------------------------------------------------------------------------
# In the pass process


class Pass:
    """Runs the workloads of one spec against one llama.cpp engine and records what came back."""

    def __init__(self, engine, token_ids: list[int]):
        self.engine = engine
        self.bank = PromptBank(token_ids)
        self.problems: list[str] = []

    def generate(self, prompt_tokens: int, max_tokens: int, purpose: str) -> dict[str, Any]:
        engine, L = self.engine, self.engine.L
        ids = self.bank.take(prompt_tokens)
        L.llama_perf_context_reset(engine.ctx)
        start = time.perf_counter()
        out = engine.generate_greedy(ids, max_tokens)
        seconds = time.perf_counter() - start
        perf = L.llama_perf_context(engine.ctx)
        record = {
            "purpose": purpose,
            "seconds": seconds,
            "prompt_tokens": len(ids),
            "gen_tokens": len(out),
            "cached_tokens": 0,  # every request starts on an empty KV cache (generate_greedy resets it)
            "finish_reason": "length",
            "engine": {"prompt_eval_s": perf.t_p_eval_ms / 1000, "n_prompt_eval": perf.n_p_eval,
                       "eval_s": perf.t_eval_ms / 1000, "n_eval": perf.n_eval},
        }
        if record["prompt_tokens"] != prompt_tokens or record["gen_tokens"] != max_tokens:
            self.problems.append(f"{purpose}: asked for {prompt_tokens}+{max_tokens} tokens, "
                                 f"got {record['prompt_tokens']}+{record['gen_tokens']}")
        return record

    def first_token(self) -> dict[str, Any]:
        return self.generate(8, 1, "first request")

    def run(self, workload: dict[str, Any], prepared_fidelity: dict[str, Any]) -> dict[str, Any]:
        kind, label = workload["kind"], workload["label"]
        requests, figures = [], {}
        if kind in ("decode", "prefill", "ttft"):
            requests, figures, full = timed_workload(workload, self.generate, self.problems)
            engine = full["engine"] if full else None
            if engine and engine["eval_s"] > 0 and engine["n_eval"] > 0:
                figures[f"{label} (engine)"] = _figure(engine["n_eval"] / engine["eval_s"], "tok/s", "higher",
                                                       ENGINE_DECODE)
        elif kind == "cold_start":
            pass  # figures come from the timings of the first request, see run_pass()
        elif kind == "fidelity":
            from vllm_omni_edge_bench.harness import fidelity

            source = fidelity.LlamaCppLogitSource(self.engine)
            outcome = fidelity.run_prepared_workload(source, workload, prepared_fidelity[label])
            figures.update(outcome["figures"])
            self.problems += outcome["problems"]
            return {"kind": kind, "label": label, "params": workload, "figures": figures, "requests": requests,
                    "fidelity": {"result": outcome["result"], "reference_key": outcome["reference_key"]}}
        else:
            raise NotImplementedError(f"workload {kind!r} is not implemented for llama.cpp passes")
        return {"kind": kind, "label": label, "params": workload, "figures": figures, "requests": requests}


def tokenizer_check(engine, spec: dict[str, Any]) -> dict[str, Any]:
    """Do the prompt ids mean the same text to llama.cpp as to the arm's HF tokenizer?"""
    ids = spec["prompt_token_ids"]
    own = engine.tokenize(FIXED_TEXT)
    return {
        "hf_tokenizer": spec["tokenizer_path"],
        "same_text_for_ids": engine.detokenize(ids) == spec["prompt_text"],
        "same_ids_for_text": own == ids,
        "ids_in_vocab": all(0 <= i < engine.n_vocab for i in ids),
    }


def _write_evidence(evidence: dict[str, Any]) -> None:
    directory = os.environ.get(EVIDENCE_ENV)
    if not directory:
        return
    from vllm_omni_edge.atomic import atomic_write_bytes

    pid = os.getpid()
    base = Path(directory)
    atomic_write_bytes(base / f"process-{pid}.json",
                       json.dumps({"pid": pid, "ppid": os.getppid(), "role": "llamacpp", "patches": []}).encode())
    worker = {"pid": pid, "ppid": os.getppid(), "role": "llamacpp", **evidence}
    atomic_write_bytes(base / f"worker-{pid}.json", json.dumps(worker, indent=2, default=str).encode())


def run_pass(spec: dict[str, Any]) -> dict[str, Any]:
    import psutil

    events = spec["events_path"]
    pass_events.emit(events, pass_events.STARTED)
    process_start = psutil.Process().create_time()

    from vllm_omni_edge_bench.baselines.llamacpp import LlamaCppEngine, LlamaCppOptions

    settings = {k: v for k, v in spec["llamacpp"].items() if k != "tokenizer"}
    constructor_start = time.perf_counter()
    engine = LlamaCppEngine(spec["model"], LlamaCppOptions(**settings))
    load_s = time.perf_counter() - constructor_start
    pass_events.emit(events, pass_events.ENGINE_READY)

    runner = Pass(engine, spec["prompt_token_ids"])
    tokens = tokenizer_check(engine, spec)
    if not tokens["same_text_for_ids"] or not tokens["ids_in_vocab"]:
        runner.problems.append(f"the prompt ids mean other text to llama.cpp than to {tokens['hf_tokenizer']}: "
                               "the GGUF's vocabulary is not the arm's tokenizer's")
    evidence = {**engine.evidence(), "tokenizer": tokens}
    _write_evidence(evidence)

    first = runner.first_token()
    first_token_t = pass_events.emit(events, pass_events.FIRST_TOKEN)
    timings = start_up_timings(process_start, first_token_t, load_s, first["seconds"])
    workloads = run_workloads(spec["workloads"], lambda w: runner.run(w, spec.get("fidelity") or {}),
                              start_up_figures(timings, "load", load_s,
                                               "wall clock: llama.cpp model load + context creation"))
    pass_events.emit(events, pass_events.WORKLOADS_DONE)

    evidence = {**engine.evidence(), "tokenizer": tokens}  # the log may have grown (e.g. graph reserves)
    _write_evidence(evidence)
    import platform

    return {
        "engine": "llamacpp",
        "arm": spec["arm"],
        "pass_index": spec["pass_index"],
        "pid": os.getpid(),
        "model": spec["model"],
        "llamacpp": spec["llamacpp"],
        "resolved_options": {k: evidence[k] for k in ("n_threads", "n_threads_batch", "n_ctx", "n_batch", "use_mmap",
                                                      "use_extra_bufts", "use_extra_bufts_reason", "flash_attn")},
        "versions": {"llama_cpp_python": evidence["llama_cpp_python"], "python": platform.python_version(),
                     "cpu_capability": _cpu_capability(evidence["compiled_features"])},
        "timings": timings,
        "first_request": first,
        "workloads": workloads,
        "problems": runner.problems,
    }


def _cpu_capability(features: dict[str, Any]) -> str:
    """The widest SIMD llama.cpp was compiled for, in PyTorch's words (AVX2, AVX512...)."""
    cpu = features.get("CPU", {})
    for name in ("AMX_INT8", "AVX512", "AVX2", "AVX"):
        if cpu.get(name) is True:
            return name
    return "scalar"


def main(argv: list[str] | None = None) -> int:
    return pass_main(run_pass, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
