"""Where a decode step's time goes: every process of a real vLLM run sampled with py-spy.

    python -m vllm_omni_edge_bench.harness.decode_profile [--model default:cpu_int4] [--layout three]
        [--duration 30] [--rate 50] [--out DIR]

Runs, in a fresh process tree:
1. a *target*: this module with ``--target``, which builds ``vllm.LLM`` like a
   harness pass (same kwargs as the grids by default), warms up, then decodes
   back-to-back greedy requests (``--prompt-tokens`` in, ``--gen-tokens`` out,
   ignore_eos) until told to stop, timestamping every engine step that brings
   tokens back (a wrapper on the front end's ``OutputProcessor.process_outputs``);
2. once it decodes, ``--settle`` seconds later, ``py-spy record --subprocesses
   --native --idle --threads --format raw`` on the target for ``--duration``
   seconds: every thread of every process of the tree, blocking samples;
3. attribution of every sample to a category by ``stack_categories.RULES`` (an
   ordered table of stack-frame patterns, printed in the report).

A category's ms/token for a thread = its share of that thread's samples x the
wall time per token measured in the same window (tokens the front end received
while py-spy ran). The main threads of the processes are reported side by side;
each column adds up to the token's wall time. Decode outside the window gives the
unprofiled ms/token, so py-spy's own cost is visible.

The artifact (``results/<date>-decode-profile-<model>-<layout>`` by default):
``decode_profile.json`` (provenance, the window, per process/thread/category
samples and ms/token, top call sites, the rule table), ``decode_profile.md``,
``pyspy.raw.gz`` (the raw stacks) and the plugin's ``evidence/``. With
``--torch-profile-tokens N`` the target then decodes N more tokens under vLLM's
torch.profiler hook (``profiler_config``) and the worker's op table (self CPU time
per aten op) lands in ``torch/``.
One run on a shared box is one observation, not a measurement: say so when
quoting it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_edge_bench.harness import provenance
from vllm_omni_edge_bench.harness.stack_categories import (
    CATEGORIES,
    FORWARD_CATEGORIES,
    ProcessProfile,
    attribute,
    parse_raw,
    rules_table,
)

LAYOUTS: dict[str, dict[str, str]] = {
    # vLLM's own layout: front end, engine core, worker (model), 1 core reserved. LLM() takes it
    # only when asked (patches/frontend/llm_in_process.py), here by vLLM's own variable.
    "three": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    # Everything in the calling process (InprocClient + UniProcExecutor).
    "inproc": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
}
# What the grids' eager arms use (grids/edge-default.yaml).
DEFAULT_LLM_KWARGS = {"enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_bytes": "192MiB"}
EVIDENCE_ENV = "VLLM_OMNI_EDGE_EVIDENCE_DIR"
DECODING_EVENT = "decoding"
PYSPY_PIN = "py-spy==0.4.2"
MIN_WINDOW_TOKENS = 20
# The module run as the target (``--target SPEC --target-out JSON``); tests swap in a fake.
TARGET_MODULE = "vllm_omni_edge_bench.harness.decode_profile"
SIGINT_GRACE_S = 60.0  # for py-spy to write its output after Ctrl-C
_SAMPLES = re.compile(r"Samples: \d+ Errors: \d+")


class ProfileError(RuntimeError):
    """The run could not produce a profile; the message says why."""


# --------------------------------------------------------------------------- target


def _emit(events_path: str, name: str, **data: Any) -> None:
    with open(events_path, "a") as fh:
        fh.write(json.dumps({"event": name, "t": time.time(), **data}) + "\n")
        fh.flush()


def run_target(spec: dict[str, Any]) -> dict[str, Any]:
    """The vLLM side: decode until ``spec['stop_path']`` exists; every token-bearing step timestamped."""
    from vllm import LLM, SamplingParams

    from vllm_omni_edge_bench.harness.prompts import PromptBank
    from vllm_omni_edge_bench.harness.sizes import parse_size

    kwargs = dict(spec["llm_kwargs"])
    if "kv_cache_memory_bytes" in kwargs:
        kwargs["kv_cache_memory_bytes"] = parse_size(kwargs["kv_cache_memory_bytes"])
    if spec.get("torch_profile_tokens"):
        # vLLM's own hook: the worker's torch.profiler, started and stopped by LLM.start/stop_profile.
        kwargs["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": spec["torch_profile_dir"],
                                     "torch_profiler_with_stack": False}
    llm = LLM(model=spec["model"], **kwargs)
    steps: list[tuple[float, int, int]] = []  # (time.time(), tokens, request index)
    request_index = [-1]
    processor = llm.llm_engine.output_processor
    process_outputs = processor.process_outputs

    def timed_process_outputs(engine_core_outputs, *args, **kw):
        tokens = sum(len(o.new_token_ids) for o in engine_core_outputs)
        if tokens:
            steps.append((time.time(), tokens, request_index[0]))
        return process_outputs(engine_core_outputs, *args, **kw)

    processor.process_outputs = timed_process_outputs
    bank = PromptBank.from_tokenizer(llm.get_tokenizer())

    def generate(gen_tokens: int) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
        start = time.time()
        out = llm.generate([{"prompt_token_ids": bank.take(spec["prompt_tokens"])}], params, use_tqdm=False)[0]
        return {"start": start, "end": time.time(), "gen_tokens": len(out.outputs[0].token_ids)}

    warmup = generate(8)
    steps.clear()
    requests = []
    _emit(spec["events_path"], DECODING_EVENT, pid=os.getpid())
    deadline = time.time() + spec["max_decode_s"]
    while not os.path.exists(spec["stop_path"]) and time.time() < deadline:
        request_index[0] = len(requests)
        requests.append(generate(spec["gen_tokens"]))
    torch_profile = None
    if spec.get("torch_profile_tokens"):
        # After the sampled window, so the two profilers never overlap; its steps are not decode timings.
        decode_steps = len(steps)
        try:
            llm.start_profile()
            torch_profile = generate(spec["torch_profile_tokens"])
            llm.stop_profile()
        except Exception as error:  # the py-spy profile above stands on its own
            torch_profile = {"error": f"{type(error).__name__}: {error}"}
        del steps[decode_steps:]
    import torch
    import vllm

    return {"pid": os.getpid(), "warmup": warmup, "requests": requests, "steps": steps,
            "torch_profile_request": torch_profile,
            "stopped_by": "stop file" if os.path.exists(spec["stop_path"]) else "max_decode_s",
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                         "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                         "torch_threads": torch.get_num_threads()}}


# --------------------------------------------------------------------------- analysis


def window_stats(steps: list[list], window: tuple[float, float]) -> dict[str, Any]:
    """Tokens the front end received inside and outside the sampled window.

    ``decode`` intervals are between consecutive steps of the same request (the
    first step of a request also carries its prefill and is left out of them).
    """
    start, end = window
    inside = [s for s in steps if start <= s[0] <= end]
    tokens = sum(s[1] for s in inside)
    intervals_in, intervals_out = [], []
    for previous, step in zip(steps, steps[1:]):
        if step[2] != previous[2]:
            continue
        interval = (step[0] - previous[0]) / step[1]
        (intervals_in if start <= previous[0] and step[0] <= end else intervals_out).append(interval)
    seconds = end - start
    first_step: dict[int, float] = {}
    for step in steps:
        first_step.setdefault(step[2], step[0])

    def ms(values: list[float]) -> dict[str, Any]:
        if not values:
            return {"n": 0, "mean_ms": None, "median_ms": None}
        ordered = sorted(values)
        return {"n": len(values), "mean_ms": 1000 * sum(values) / len(values),
                "median_ms": 1000 * ordered[len(ordered) // 2]}

    return {
        "window_s": seconds,
        "tokens": tokens,
        "requests_started": len({r for r, t in first_step.items() if start <= t <= end}),
        "ms_per_token": 1000 * seconds / tokens if tokens else None,
        "decode_interval_in_window": ms(intervals_in),
        "decode_interval_unprofiled": ms(intervals_out),
        "covered": bool(steps) and steps[0][0] <= start and steps[-1][0] >= end,
    }


STRETCH_LIMIT = 2.0  # py-spy's cost beyond this makes the shares a picture of py-spy, not of vLLM


def pyspy_stretch_warning(window: dict[str, Any], limit: float = STRETCH_LIMIT) -> str | None:
    """A warning when sampling slowed decode by more than ``limit``: the shares per category
    assume py-spy slows every category alike, which stops holding once it takes the cores."""
    inside = window["decode_interval_in_window"]["mean_ms"]
    outside = window["decode_interval_unprofiled"]["mean_ms"]
    if not inside or not outside or inside / outside <= limit:
        return None
    return (f"py-spy stretched the decode step {inside / outside:.1f}x ({inside:.1f} vs {outside:.1f} ms "
            f"unprofiled): the shares below are unreliable; lower --rate or trust the torch.profiler table")


def _role(process: ProcessProfile, root_pid: int, roles: dict[int, str]) -> str:
    from vllm_omni_edge_bench.harness.ledger import canonical_role

    return canonical_role(roles.get(process.pid, process.command), is_root=process.pid == root_pid)


def summarise(processes: dict[int, ProcessProfile], root_pid: int, roles: dict[int, str],
              ms_per_token: float | None, top: int = 12) -> dict[str, Any]:
    """Samples and ms/token per process, thread and category; top call sites per thread."""
    out = []
    for process in sorted(processes.values(), key=lambda p: (p.pid != root_pid, p.pid)):
        threads = []
        for thread in sorted(process.threads.values(), key=lambda t: (not t.is_main, -t.busy)):
            per_token = ({c: ms_per_token * n / thread.samples for c, n in thread.by_category.items()}
                         if ms_per_token and thread.samples else None)
            sites = [{"category": c, "python": py, "leaf": leaf, "samples": n,
                      "ms_per_token": ms_per_token * n / thread.samples if ms_per_token else None}
                     for (c, py, leaf), n in thread.by_site.most_common() if c != "idle"][:top]
            threads.append({"tid": thread.tid, "name": thread.name, "main": thread.is_main,
                            "samples": thread.samples, "busy_samples": thread.busy,
                            "samples_by_category": dict(thread.by_category), "ms_per_token": per_token,
                            "top_busy_sites": sites})
        out.append({"pid": process.pid, "role": _role(process, root_pid, roles), "command": process.command,
                    "samples": process.samples, "threads": threads})
    return {"processes": out}


def unmatched_sites(processes: dict[int, ProcessProfile], top: int = 15) -> list[dict[str, Any]]:
    counts: dict[tuple[str, str], int] = {}
    for process in processes.values():
        for thread in process.threads.values():
            for (category, python, leaf), n in thread.by_site.items():
                if category == "other":
                    counts[(python, leaf)] = counts.get((python, leaf), 0) + n
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [{"python": p, "leaf": leaf, "samples": n} for (p, leaf), n in ranked]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(record: dict[str, Any]) -> str:
    window, summary = record["window"], record["profile"]
    mains = []
    for process in summary["processes"]:
        main = next((t for t in process["threads"] if t["main"]), None)
        if main is not None:
            mains.append((process, main))
    lines = [
        f"# Decode profile: {record['model_name']}, layout `{record['layout']}`",
        "",
        "One run on a shared box: an observation, not a harness measurement.",
        "",
        f"- Wall time per token while sampled: **{_fmt(window['ms_per_token'])} ms** "
        f"({window['tokens']} tokens in {window['window_s']:.1f} s, {window['requests_started']} new requests "
        f"of {record['spec']['gen_tokens']} tokens started inside).",
        f"- Decode step interval: {_fmt(window['decode_interval_in_window']['mean_ms'])} ms mean while sampled, "
        f"{_fmt(window['decode_interval_unprofiled']['mean_ms'])} ms unprofiled "
        f"(n={window['decode_interval_unprofiled']['n']}): py-spy's cost is the difference.",
        f"- {record['pyspy']['version']}: {record['pyspy']['rate_hz']} Hz, {record['pyspy']['summary']} "
        f"(window from {record['pyspy']['window_from']}).",
        f"- Load average before/after: {record['load_average_before']} / {record['load_average_after']}.",
        *([f"- **{stretch}.**"] if (stretch := pyspy_stretch_warning(window)) else []),
        "",
        "## ms per token, main thread of each process",
        "",
        "Each column sums to the token's wall time: a process's idle is time it waited for the others.",
        "",
        "| category | " + " | ".join(f"{p['role']} ({p['pid']})" for p, _ in mains) + " |",
        "|---|" + "---:|" * len(mains),
    ]
    for category in CATEGORIES:
        values = [(m["ms_per_token"] or {}).get(category, 0.0) for _, m in mains]
        if not any(values):
            continue
        label = f"forward: {category}" if category in FORWARD_CATEGORIES else category
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    lines.append("| **total** | " + " | ".join(
        f"**{sum((m['ms_per_token'] or {}).values()):.1f}**" for _, m in mains) + " |")
    lines.append("| samples | " + " | ".join(str(m["samples"]) for _, m in mains) + " |")
    lines += ["", "## Other threads (busy ms per token)", "",
              "| process | thread | busy ms/token | categories (ms/token) |", "|---|---|---:|---|"]
    for process in summary["processes"]:
        for thread in process["threads"]:
            if thread["main"] or not thread["ms_per_token"]:
                continue
            busy = {c: v for c, v in thread["ms_per_token"].items() if c != "idle" and v >= 0.05}
            if not busy:
                continue
            parts = ", ".join(f"{c} {v:.1f}" for c, v in sorted(busy.items(), key=lambda kv: -kv[1]))
            lines.append(f"| {process['role']} ({process['pid']}) | {thread['name'] or thread['tid']} | "
                         f"{sum(busy.values()):.1f} | {parts} |")
    lines += ["", "## Top busy call sites, main threads", ""]
    for process, main in mains:
        lines += [f"### {process['role']} ({process['pid']})", "",
                  "| ms/token | category | innermost Python frame | leaf frame |", "|---:|---|---|---|"]
        for site in main["top_busy_sites"]:
            lines.append(f"| {_fmt(site['ms_per_token'], 2)} | {site['category']} | `{site['python']}` | "
                         f"`{site['leaf']}` |")
        lines.append("")
    if record["unmatched"]:
        lines += ["## Samples no rule matched (category `other`)", "", "| samples | innermost Python frame | leaf |",
                  "|---:|---|---|"]
        lines += [f"| {u['samples']} | `{u['python']}` | `{u['leaf']}` |" for u in record["unmatched"]]
        lines.append("")
    lines += ["## The mapping (first matching rule wins)", "", "| # | category | kind | pattern | why |",
              "|---:|---|---|---|---|"]
    for row in record["rules"]:
        pattern = row["pattern"].replace("|", "\\|")
        unless = f" (unless a tail frame matches `{row['unless_tail']}`)".replace("|", "\\|") if row["unless_tail"] else ""
        lines.append(f"| {row['order']} | {row['category']} | {row['kind']} | `{pattern}` | {row['why']}{unless} |")
    lines += ["", "## Categories", ""]
    lines += [f"- `{name}`: {meaning}" for name, meaning in CATEGORIES.items()]
    torch_profile = record.get("torch_profile")
    if torch_profile and torch_profile["table_head"]:
        lines += ["", f"## torch.profiler in the worker ({record['spec']['torch_profile_tokens']} tokens, after the "
                  f"py-spy window; `torch/{torch_profile['tables'][0]}`)", "", "```"]
        lines += torch_profile["table_head"] + ["```"]
    if record.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in record["warnings"]]
    problems = record.get("problems") or []
    if problems:
        lines += ["", "## Problems", ""] + [f"- {p}" for p in problems]
    lines += ["", f"Command: `{' '.join(record['provenance']['command'])}`; git {record['provenance']['git']['sha']}"
              f"{' (dirty)' if record['provenance']['git']['dirty'] else ''}; env overlay "
              f"`{json.dumps(record['env_overlay'])}`.", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- orchestration


def find_pyspy() -> str:
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise ProfileError(f"py-spy not found next to {sys.executable} or on PATH; install {PYSPY_PIN} "
                           "(pinned in pyproject.toml and requirements/lock.txt)")
    return found


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ProfileError(f"--env wants NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def _wait_for_event(events_path: Path, name: str, proc: subprocess.Popen, timeout_s: float) -> dict[str, Any]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if events_path.exists():
            for line in events_path.read_text().splitlines():
                event = json.loads(line)
                if event["event"] == name:
                    return event
        if proc.poll() is not None:
            raise ProfileError(f"the target exited with code {proc.returncode} before {name!r}")
        time.sleep(0.2)
    raise ProfileError(f"the target did not reach {name!r} within {timeout_s:g} s")


def _stop_tree(proc: subprocess.Popen) -> None:
    """End the target's process group (it runs in its own session), TERM first."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 2.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


@dataclass
class PyspyRun:
    returncode: int
    lines: list[str]
    window: tuple[float, float]  # wall clock (time.time) of the sampling
    window_from: str  # how the window was found


def run_pyspy(command: list[str], timeout_s: float) -> PyspyRun:
    """Run py-spy, timestamping its output: sampling runs from "Sampling process" to "Wrote".

    Attaching to every process of the tree (and reading their symbols for --native)
    takes seconds before the first sample; the lines bound the sampling itself.
    """
    launched = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stamped: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            if line.strip():
                stamped.append((time.time(), line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # Behind in sampling (native unwinding of a large tree is slow): Ctrl-C makes py-spy
        # stop and write what it has, which is still a uniform sample of the window.
        proc.send_signal(signal.SIGINT)
        stamped.append((time.time(), f"decode_profile: sent SIGINT after {timeout_s:g} s"))
        try:
            proc.wait(timeout=SIGINT_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join(timeout=5)
            raise ProfileError(f"py-spy did not finish within {timeout_s:g} s nor stop on SIGINT: "
                               + " / ".join(line for _, line in stamped[-10:])) from None
    exited = time.time()
    reader.join(timeout=5)
    began = next((t for t, line in stamped if "Sampling process" in line), None)
    wrote = next((t for t, line in stamped if "Wrote raw" in line or "Stopped sampling" in line), None)
    window = (began or launched, wrote or exited)
    window_from = ("py-spy's output lines" if began and wrote
                   else "launch and exit of py-spy (its start/finish lines were not seen)")
    return PyspyRun(proc.returncode, [line for _, line in stamped], window, window_from)


def profile(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from vllm_omni_edge_bench.harness.evidence import collect_evidence, roles_by_pid
    from vllm_omni_edge_bench.harness.grid import resolve_model

    pyspy = find_pyspy()
    model = resolve_model(args.model)
    if not Path(model).exists():
        raise ProfileError(f"model {model} does not exist (build it with `vllm-omni-edge models pull ...`)")
    llm_kwargs = {**DEFAULT_LLM_KWARGS, **json.loads(args.llm_kwargs)} if args.llm_kwargs else dict(DEFAULT_LLM_KWARGS)
    if args.quantization:
        llm_kwargs["quantization"] = args.quantization
    overlay = {**LAYOUTS[args.layout], **_parse_env(args.env), EVIDENCE_ENV: str(work / "evidence"),
               "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    (work / "evidence").mkdir()
    spec = {"model": model, "llm_kwargs": llm_kwargs, "prompt_tokens": args.prompt_tokens,
            "gen_tokens": args.gen_tokens, "events_path": str(work / "events.jsonl"),
            "torch_profile_tokens": args.torch_profile_tokens, "torch_profile_dir": str(work / "torch"),
            "stop_path": str(work / "stop"),
            "max_decode_s": args.settle + args.duration + args.attach_timeout + 60}
    (work / "spec.json").write_text(json.dumps(spec, indent=2))
    env = {**os.environ, **overlay}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(provenance.PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    record: dict[str, Any] = {"provenance": provenance.collect(grid_text="", argv=args.argv),
                              "model_name": args.model, "model": model, "layout": args.layout,
                              "env_overlay": {k: v for k, v in overlay.items() if k != EVIDENCE_ENV}, "spec": spec,
                              "load_average_before": os.getloadavg(), "problems": []}
    log_path = work / "target.log"
    command = [sys.executable, "-m", TARGET_MODULE, "--target", str(work / "spec.json"),
               "--target-out", str(work / "target.json")]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=provenance.PROJECT_ROOT, start_new_session=True)
    try:
        _wait_for_event(work / "events.jsonl", DECODING_EVENT, proc, args.start_timeout)
        time.sleep(args.settle)
        pyspy_cmd = [pyspy, "record", "--pid", str(proc.pid), "--subprocesses", "--native", "--idle", "--threads",
                     "--rate", str(args.rate), "--duration", str(args.duration), "--format", "raw",
                     "--output", str(work / "pyspy.raw")]
        sampled = run_pyspy(pyspy_cmd, timeout_s=args.duration + args.attach_timeout)
        Path(spec["stop_path"]).touch()
        proc.wait(timeout=args.start_timeout)
    except BaseException as error:
        _stop_tree(proc)
        if isinstance(error, (ProfileError, subprocess.TimeoutExpired)):
            raise ProfileError(f"{error}\n--- target log tail ---\n{_log_tail(log_path)}") from None
        raise
    record["load_average_after"] = os.getloadavg()
    if proc.returncode != 0 or not (work / "target.json").exists():
        raise ProfileError(f"the target exited with code {proc.returncode}\n{_log_tail(log_path)}")
    if sampled.returncode != 0 or not (work / "pyspy.raw").exists():
        raise ProfileError(f"py-spy failed ({sampled.returncode}): {' / '.join(sampled.lines[-20:])}")
    target = json.loads((work / "target.json").read_text())
    version = subprocess.run([pyspy, "--version"], capture_output=True, text=True).stdout.strip()
    start, end = sampled.window
    record["pyspy"] = {"command": pyspy_cmd, "version": version, "rate_hz": args.rate, "duration_s": args.duration,
                       "output": sampled.lines[-40:], "window_from": sampled.window_from,
                       "summary": next((m.group(0) for m in map(_SAMPLES.search, reversed(sampled.lines)) if m),
                                       "no sample count reported")}
    # Behind in sampling: fewer samples than asked for, still spread over the window.
    record["warnings"] = [f"py-spy: {line}" for line in sampled.lines if "behind" in line or "SIGINT" in line][:5]
    record["target"] = {k: v for k, v in target.items() if k != "steps"}
    record["steps"] = target["steps"]
    window = window_stats(target["steps"], (start, end))
    record["window"] = {**window, "start": start, "end": end}
    if not window["covered"]:
        record["problems"].append("decode did not span the whole sampled window")
    if window["tokens"] < MIN_WINDOW_TOKENS:
        record["problems"].append(f"only {window['tokens']} tokens inside the window (< {MIN_WINDOW_TOKENS})")
    raw_text = (work / "pyspy.raw").read_text()
    stacks = parse_raw(raw_text)
    processes = attribute(stacks)
    evidence = collect_evidence(work / "evidence")
    record["evidence"] = evidence
    record["profile"] = summarise(processes, target["pid"], roles_by_pid(evidence), window["ms_per_token"])
    record["unmatched"] = unmatched_sites(processes)
    record["rules"] = rules_table()
    record["categories"] = CATEGORIES
    tree = {process["pid"] for process in record["profile"]["processes"]}
    if target["pid"] not in tree:
        record["problems"].append(f"no samples from the target process {target['pid']}")
    if args.torch_profile_tokens:
        record["torch_profile"] = _keep_torch_tables(work / "torch", args.keep_torch_trace)
        if not record["torch_profile"]["tables"]:
            record["problems"].append(f"--torch-profile-tokens: no profiler_out_*.txt in {work / 'torch'}")
    with open(work / "pyspy.raw", "rb") as src, gzip.open(work / "pyspy.raw.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    (work / "pyspy.raw").unlink()
    Path(spec["stop_path"]).unlink(missing_ok=True)
    record["provenance"]["finished"] = provenance.now_iso()
    return record


def _keep_torch_tables(directory: Path, keep_traces: bool) -> dict[str, Any]:
    """vLLM's per-rank op tables (self CPU time, top 50) stay; the traces go unless asked for (MBs)."""
    tables = sorted(p.name for p in directory.glob("profiler_out_*.txt")) if directory.is_dir() else []
    traces = [p for p in directory.rglob("*.json*")] if directory.is_dir() else []
    if not keep_traces:
        for trace in traces:
            trace.unlink()
    head = (directory / tables[0]).read_text().splitlines()[:40] if tables else []
    return {"dir": "torch", "tables": tables, "table_head": head, "traces_kept": keep_traces,
            "traces": [str(t.relative_to(directory)) for t in traces]}


def default_out(model_name: str, layout: str) -> Path:
    from vllm_omni_edge_bench.harness.runner import RESULTS_ROOT, unused_dir

    safe = model_name.replace(":", "-").replace("/", "_")
    return unused_dir(RESULTS_ROOT / f"{time.strftime('%Y-%m-%d')}-decode-profile-{safe}-{layout}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default:cpu_int4",
                        help="checkpoint dir or embedded model name, NAME[:cpu_int4] [default:cpu_int4]")
    parser.add_argument("--quantization", default=None, help="LLM(quantization=...), e.g. cpu_int4 to quantize at load")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="three",
                        help="process layout: three (vLLM's, VLLM_ENABLE_V1_MULTIPROCESSING=1), inproc (=0)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the vLLM run (repeatable), e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0")
    parser.add_argument("--llm-kwargs", default=None,
                        help=f"JSON merged over the default LLM kwargs {json.dumps(DEFAULT_LLM_KWARGS)}")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=256, help="tokens per decode request (back to back)")
    parser.add_argument("--duration", type=int, default=30, help="seconds py-spy samples")
    parser.add_argument("--rate", type=int, default=50,
                        help="py-spy samples per second (100 stretched a 2-core box's step 8-15x)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds of unprofiled decode before sampling")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for vLLM to start and warm up")
    parser.add_argument("--attach-timeout", type=float, default=60.0,
                        help="seconds py-spy may take beyond --duration (attaching, symbols)")
    parser.add_argument("--torch-profile-tokens", type=int, default=0,
                        help="after the py-spy window, decode this many tokens under vLLM's torch.profiler "
                             "(worker op table in torch/profiler_out_0.txt); 0 = off, and vLLM gets no profiler config")
    parser.add_argument("--keep-torch-trace", action="store_true", help="keep the torch.profiler traces (large)")
    parser.add_argument("--out", type=Path, default=None, help="artifact directory [results/<date>-decode-profile-...]")
    parser.add_argument("--target", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--target-out", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # For provenance: the command as a user would type it.
    args.argv = sys.argv if argv is None else ["-m", "vllm_omni_edge_bench.harness.decode_profile", *argv]
    if args.target is not None:
        result = run_target(json.loads(args.target.read_text()))
        from vllm_omni_edge.atomic import atomic_write_bytes

        atomic_write_bytes(args.target_out, json.dumps(result).encode())
        return 0
    for name, value, low in (("--duration", args.duration, 1), ("--rate", args.rate, 1),
                             ("--gen-tokens", args.gen_tokens, 2), ("--prompt-tokens", args.prompt_tokens, 1)):
        if value < low:
            parser.error(f"{name} must be at least {low}, got {value}")
    from vllm_omni_edge.atomic import atomic_directory

    out = args.out or default_out(args.model, args.layout)
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out} is not empty; profiles are never overwritten")
    try:
        with atomic_directory(out) as work:
            record = profile(args, work)
            (work / "decode_profile.json").write_text(json.dumps(record, indent=2, default=str))
            (work / "decode_profile.md").write_text(render_markdown(record))
    except ProfileError as error:
        print(f"decode_profile: {error}", file=sys.stderr)
        return 1
    print((out / "decode_profile.md").read_text())
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
