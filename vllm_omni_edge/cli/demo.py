"""``vllm-omni-edge demo``: the main job, end to end, on the embedded default model.

Pull the model (its cpu_int4 checkpoint by default: the routed 4-bit kernels are what a
user deploys; ``--weights bf16`` shows stock vLLM-CPU's weights), start the
OpenAI-compatible server on 127.0.0.1, compiled or eager as ``vllm serve`` decides, ask one chat
question through the ``openai`` client, stream the answer, print decode tokens/s
and whole-process-tree PSS, and shut the server down cleanly.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from vllm_omni_edge.memory import process_tree_memory, tree_total


SERVED_NAME = "SmolLM2-135M-Instruct"
DECODE_TOKENS = 128  # tg128, as llama-bench measures decode


@dataclass
class DemoResult:
    answer: str
    completion_tokens: int
    decode_tokens_per_s: float
    ttft_s: float
    startup_s: float
    pss_bytes: int
    pss_anon_bytes: int
    pss_file_bytes: int
    processes: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mib(n: int) -> float:
    return n / (1 << 20)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30) -> int | None:
    """SIGINT (vLLM's clean shutdown), then SIGTERM, then SIGKILL the process group."""
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    # Children left behind by a crash would hold memory on an edge box.
    left = _group_members(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously: return only once the group is gone.
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:
        left = [p for p in left if _alive(p)]
        if left:
            time.sleep(0.02)
    return proc.returncode


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid:
                members.append(p)
    return members


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ServerProcess:
    """A ``vllm-omni-edge serve`` child in its own session, so it can be stopped whole."""

    def __init__(self, model: str, port: int, extra_args: list[str], log_path: Path, env=None,
                 argv_prefix: list[str] | None = None):
        self.port = port
        self.log_path = log_path
        self._log = open(log_path, "wb")
        if argv_prefix is None:
            argv_prefix = [sys.executable, "-m", "vllm_omni_edge.cli.main", "serve"]
        cmd = [*argv_prefix, model, "--port", str(port), *extra_args]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env=env,
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode} before it was ready; "
                    f"log: {self.log_path}\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.1)  # the wait is a measured start-up time: poll finely
        raise TimeoutError(f"server not ready after {timeout_s:.0f} s; log: {self.log_path}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 30) -> int:
        returncode = stop_process_group(self.proc, grace_s)
        self._log.close()
        return returncode


def ask_streaming(base_url: str, question: str, max_tokens: int, out=sys.stdout,
                  ignore_eos: bool = False):
    """Stream one greedy chat answer; return (text, completion_tokens, ttft, decode tok/s).

    ``ignore_eos`` makes the answer exactly ``max_tokens`` long, for a decode rate
    measured over a fixed number of tokens.
    """
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key=os.environ.get("VLLM_API_KEY", "EMPTY"))
    sent = time.monotonic()
    first = last = None
    pieces: list[str] = []
    usage = None
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if ignore_eos else None,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = choice.delta.content or ""
            if text:
                now = time.monotonic()
                first = first or now
                last = now
                pieces.append(text)
                if out is not None:
                    out.write(text)
                    out.flush()
    if out is not None:
        out.write("\n")
    if usage is None or first is None:
        raise RuntimeError("the server streamed no tokens or no usage record")
    tokens = usage.completion_tokens
    # Decode rate excludes the first token, whose time is prefill.
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return "".join(pieces), tokens, first - sent, decode


def pull_demo_model(weights: str, progress) -> Path:
    """The default model's checkpoint in ``weights`` (built once into the user cache)."""
    from vllm_omni_edge.models.default_model import (
        DEFAULT_MODEL, DEMO_WEIGHTS, pull_cpu_int4_model, pull_default_model)

    if weights == "cpu_int4":
        return pull_cpu_int4_model(DEFAULT_MODEL, progress=progress)
    if weights == "bf16":
        return pull_default_model(progress=progress)
    raise ValueError(f"unknown demo weights {weights!r}; choose one of {', '.join(DEMO_WEIGHTS)}")


def served_kernels(server_log: str) -> str | None:
    """The server's one-line cpu_int4 kernel summary (quantization/evidence.py), if it logged one."""
    found = re.search(r"cpu_int4: (\d+ layers, kernels \{[^}]*\})", server_log)
    return found.group(1) if found else None


def run_demo(question: str, max_tokens: int, compiled: bool, startup_timeout_s: float,
             multi_process: bool = False, weights: str = "cpu_int4") -> DemoResult:
    """Serve the default model, ask ``question``, measure decode and memory, stop the server.

    Compiled or eager as ``vllm serve`` decides it (``compile_choice``: eager where our decoder
    stack runs decode, so the default model starts with nothing to compile); ``compiled=False``
    passes ``--enforce-eager`` whatever the model.

    The server's defaults throughout (one process, edge serving defaults); ``multi_process``
    keeps vLLM's layout.
    """
    from tqdm import tqdm

    with tqdm(total=None, desc="default model", unit="step", leave=False) as bar:
        model = pull_demo_model(weights, lambda msg: (bar.set_postfix_str(msg), bar.update()))
    print(f"model: {model} ({weights})")
    if weights == "cpu_int4":
        from vllm_omni_edge.cli.serve import build_kernels_if_missing

        build_kernels_if_missing()

    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="edge-demo-")) / "server.log"
    # The serving defaults a user gets (cli/serving_defaults.py); only the name is ours.
    extra = ["--served-model-name", SERVED_NAME, "--disable-uvicorn-access-log"]
    if not compiled:
        extra.append("--enforce-eager")
    if multi_process:
        extra.append("--multi-process")
    layout = "vLLM's three processes" if multi_process else "one process"
    print(f"starting server on 127.0.0.1:{port} ({layout}, {weights}{'' if compiled else ', eager'}); log: {log}")
    from vllm_omni_edge.cli.serving_defaults import compile_said

    print(compile_said(extra, str(model)))
    server = ServerProcess(str(model), port, extra, log)
    try:
        startup = server.wait_ready(startup_timeout_s)
        print(f"server ready in {startup:.1f} s")
        if weights == "cpu_int4":
            kernels = served_kernels(server.log_path.read_text(errors="replace"))
            if kernels is None:
                raise RuntimeError(f"the server logged no cpu_int4 kernel summary; log: {log}")
            print(f"cpu_int4: {kernels}")
        print(f"\nQ: {question}\nA: ", end="")
        answer, tokens, ttft, _ = ask_streaming(server.base_url, question, max_tokens)
        # The answer is a few tokens; decode speed is measured on a fixed-length one.
        _, decode_tokens, _, decode = ask_streaming(
            server.base_url, "Tell me a long story.", DECODE_TOKENS, out=None, ignore_eos=True
        )
        memory = process_tree_memory(server.proc.pid)
    finally:
        code = server.stop()
    total = tree_total(memory)
    result = DemoResult(
        answer=answer,
        completion_tokens=tokens,
        decode_tokens_per_s=decode,
        ttft_s=ttft,
        startup_s=startup,
        pss_bytes=total["pss"],
        pss_anon_bytes=total["pss_anon"],
        pss_file_bytes=total["pss_file"],
        processes=len(memory),
    )
    print(
        f"\nanswer: {tokens} tokens, time to first token {ttft:.2f} s\n"
        f"decode: {decode:.1f} tok/s over {decode_tokens} tokens (greedy, one stream)\n"
        f"server tree PSS {mib(result.pss_bytes):.0f} MiB over {result.processes} processes "
        f"(anon {mib(result.pss_anon_bytes):.0f} MiB, file {mib(result.pss_file_bytes):.0f} MiB)\n"
        f"server stopped (exit code {code})"
    )
    return result
