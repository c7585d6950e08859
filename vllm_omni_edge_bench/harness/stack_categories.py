"""Sampled stacks -> where the time went: py-spy raw stacks parsed and sorted into categories.

The mapping is the ordered table ``RULES`` below: the first rule that matches a
stack names its category, so the table reads top to bottom like the decision.
A stack is the one py-spy prints in ``--format raw --native --threads
--subprocesses`` mode: ``process P:"cmd";...;thread (TID): NAME;frame;...;leaf COUNT``,
root first. A Python frame reads ``func (path.py:line)``, a native one
``symbol (libfoo.so)`` or ``0xADDR (libfoo.so)``.

Four kinds of rule:
- ``tail``: matches a frame of the *native tail*, the native frames below the
  innermost Python frame. That is where a thread blocks (a futex, poll, the GIL)
  or computes inside an op;
- ``any``: matches any frame of the stack (the Python call path, e.g. the model
  runner's ``_prepare_inputs``);
- ``innermost``: matches the innermost Python frame only;
- ``forward``: the stack is inside the model's forward; it is then split by
  what the leaf is doing (below).

Inside the forward a sample whose leaf is the interpreter or torch's Python
bindings (a ``.py`` frame, libpython, libtorch_python) counts as
``python_dispatch``; a sample in native compute counts as ``linear``,
``attention`` or ``torch_other`` by its call path. So the dispatcher of
libtorch_cpu (c10::Dispatcher) counts with the op it dispatches.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

# The categories, in report order, each with what it means.
CATEGORIES: dict[str, str] = {
    "linear": "model forward, native compute under a linear layer (int4pack / oneDNN / F.linear; lm head too)",
    "attention": "model forward, native compute under the attention layer (CPU_ATTN kernels, KV write)",
    "torch_other": "model forward, other native torch ops (norms, rope, activation, embedding, add, copy)",
    "python_dispatch": "model forward, leaf in the interpreter or torch's Python bindings",
    "input_prep": "model runner input preparation (_update_states, _prepare_inputs, attention metadata)",
    "sampling": "logits -> token: v1/sample (sampler, logits processors) and the runner's _sample",
    "runner_bookkeeping": "model runner after sampling (_bookkeeping_sync, output lists)",
    "scheduler": "engine core scheduler and KV-cache manager (schedule, update_from_output)",
    "busy_loop": "engine-core / worker / executor / LLM client loop glue and request intake, outside the above",
    "polling": "busy-wait for the next message (shm_broadcast spin with sched_yield)",
    "ipc": "messaging between processes: shm ring buffer, zmq, msgspec/pickle (de)serialization",
    "output_processing": "front end: output processor, detokenizer, logprobs, RequestOutput",
    "python_gc": "Python's cyclic garbage collector (gc_collect_main)",
    "gil_wait": "waiting for the GIL (take_gil)",
    "idle": "blocked in a wait (futex, poll, epoll, sleep, blocking read/recv)",
    "harness": "the profiler's own driving code in the front end",
    "other": "no rule matched (see the top unmatched frames in the report)",
}
FORWARD_CATEGORIES = ("linear", "attention", "torch_other", "python_dispatch")
KINDS = ("tail", "any", "innermost", "forward")

# Native libraries whose frames mean "computing inside an op", never "waiting".
_COMPUTE_LIB = r"\((lib(torch_cpu|c10|gomp|iomp5|dnnl|mkl\w*|sleef|openblas)[^()]*|_C\.abi3\.so|_C\.cpython[^()]*|[^()]*vllm[^()]*\.so)\)$"
_BLOCKING_NATIVE = (
    r"^(epoll_wait|epoll_pwait2?|__GI_epoll_wait|poll|ppoll|__poll|__GI___poll|select|__select|pselect6?"
    r"|clock_nanosleep\S*|__clock_nanosleep\S*|nanosleep|__nanosleep|time_sleep|pysleep"
    r"|pthread_cond_(timed|clock)?wait\S*|__pthread_cond_\w*wait\S*|sem_(timed|clock)?wait\S*|__new_sem_wait\S*"
    r"|do_futex_wait\S*|__futex_abstimed_wait\S*|futex_wait\S*|PyThread_acquire_lock_timed|lock_PyThread_acquire_lock"
    r"|read|__libc_read|__GI___libc_read|recv|recvfrom|recvmsg|__libc_recv\S*|accept4?|waitpid|__waitpid|wait4"
    r"|pthread_join|__pthread_clockjoin_ex|sigtimedwait|sigwaitinfo|pause"
    r"|zmq_poll|zmq::signaler_t::wait\S*|zmq::socket_poller_t::wait\S*|zmq::epoll_t::loop\S*) "
)


@dataclass(frozen=True)
class Rule:
    category: str
    kind: str  # "tail" | "any" | "innermost" | "forward"
    pattern: str
    why: str
    exclude_tail: str | None = None  # the rule does not apply if a native-tail frame matches this

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"rule for unknown category {self.category!r}")
        if self.kind not in KINDS:
            raise ValueError(f"rule kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        object.__setattr__(self, "regex", re.compile(self.pattern))
        object.__setattr__(self, "exclude_regex", re.compile(self.exclude_tail) if self.exclude_tail else None)


_FORWARD = (r"(_model_forward|compute_logits) \([^()]*v1/worker/|\(vllm/model_executor/models/"
            r"|\(vllm_omni_edge/quantization/"
            # Decode steps on our C++ decoder stack: called from its _model_forward wrapper, or,
            # for a steady step, from stack_step_inputs' _run.
            r"|^_model_forward \([^()]*patches/worker/decoder_stack\.py|^_run \([^()]*patches/worker/stack_step_inputs\.py")
_LINEAR = (r"\(vllm_omni_edge/quantization/(linear|kernels/)|\(vllm/model_executor/layers/(linear|utils)\.py"
           r"|\(vllm/model_executor/layers/quantization/|_weight_int4pack_mm|int4_scaled_mm|cpu_gemm_wna16"
           r"|edge_cpu_int4::|w4a8_(mm|vnni_mm|vnni_rows16_mm|avx2_rows8_mm|matmul)|tile_rows(8|16)|dot_(row|cols)"
           r"|at::native::linear|at::native::addmm|at::_ops::(linear|addmm|mm)|dnnl|onednn|mkldnn")
_ATTENTION = (r"\(vllm/model_executor/layers/attention/|\(vllm/v1/attention/backends/cpu_attn\.py"
              r"|unified_attention|cpu_attention|paged_attention|reshape_and_cache|cpu_attn|decode_attention|attend_heads")

# Ordered: the first match wins.
RULES: tuple[Rule, ...] = (
    Rule("gil_wait", "tail", r"^(take_gil|drop_gil|PyEval_RestoreThread|PyEval_AcquireThread) \(",
         "the thread holds no GIL and waits to get it back"),
    Rule("python_gc", "tail", r"^(gc_collect_main|gc_collect_with_callback|gc_collect_generations|_PyGC_Collect) \(",
         "the cyclic GC runs in whatever thread allocated past the threshold"),
    Rule("idle", "tail", _BLOCKING_NATIVE,
         "blocked in the kernel or on a lock, not inside a torch op (an OpenMP barrier inside an op is compute)",
         exclude_tail=_COMPUTE_LIB),
    Rule("polling", "any", r"^(acquire_read|wait) \([^()]*shm_broadcast\.py|^sched_yield |^spinloop ",
         "shm_broadcast readers spin with sched_yield for busy_loop_s (1 s) after each read"),
    Rule("input_prep", "any",
         r"^(_update_states|_prepare_inputs|_build_attention_metadata|_preprocess|_prepare_input_ids"
         r"|_get_cumsum_and_arange|_determine_batch_execution_and_padding|_get_slot_mappings|_compute_prev_positions"
         r"|_calc_spec_decode_metadata|synchronize_input_prep|_may_reorder_batch|_get_positions"
         r"|_init_model_kwargs|_prepare_kv_sharing_fast_prefill) \([^()]*v1/worker/",
         "the runner's steps before the forward; attention metadata builders run inside them"),
    Rule("linear", "forward", _LINEAR, "native compute below a linear layer or our cpu_int4 kernels"),
    Rule("attention", "forward", _ATTENTION, "native compute below the attention layer"),
    Rule("torch_other", "forward", r".", "any other native compute inside the forward"),
    Rule("sampling", "any", r"\(vllm/v1/sample/|^_sample \([^()]*v1/worker/",
         "the sampler and logits processors"),
    Rule("runner_bookkeeping", "any",
         r"^(_bookkeeping_sync|_update_states_after_model_execute|_to_list|sample_tokens|execute_model"
         r"|_copy_valid_sampled_token_count|get_output) \([^()]*v1/worker/(gpu_model_runner|cpu_model_runner)\.py",
         "the runner outside input preparation, forward and sampling"),
    Rule("scheduler", "any", r"\(vllm/v1/core/|\(vllm/v1/structured_output/|\(vllm/v1/request\.py",
         "scheduler.schedule / update_from_output and the KV-cache manager"),
    Rule("ipc", "any",
         r"\(vllm/distributed/device_communicators/shm_broadcast\.py|\(zmq/|\(vllm/v1/serial_utils\.py|msgspec"
         r"|\(pickle\.py|_pickle|cloudpickle|\(multiprocessing/(connection|reduction|queues)\.py|libzmq"
         r"|^(process_input_sockets|process_output_sockets|process_outputs_socket|_send_input\w*|send_multipart"
         r"|recv_multipart) \(",
         "moving a message: shm ring buffer, zmq sockets, (de)serialization"),
    Rule("output_processing", "any",
         r"\(vllm/v1/engine/(output_processor|detokenizer|logprobs|parallel_sampling)\.py|\(tokenizers/"
         r"|\(transformers/tokenization|\(vllm/outputs\.py|\(vllm/tokenizers/",
         "the front end turning engine outputs into RequestOutputs and text"),
    Rule("busy_loop", "any",
         r"\(vllm/v1/engine/(core|core_client|llm_engine|input_processor)\.py|\(vllm/v1/executor/|\(vllm/v1/worker/"
         r"|\(vllm/entrypoints/|\(vllm/(inputs|renderers?)/|\(vllm_omni_edge/patches/",
         "engine-core, client, executor and worker loop code, LLM.generate and request intake "
         "(and our patches' wrappers there)"),
    Rule("harness", "innermost", r"\(vllm_omni_edge_bench/harness/",
         "the profiler's own code is running (its frames are below everything in the front end)"),
)

_PY_FRAME = re.compile(r"\((?:[^()]*\.py|<frozen [^>]+>|<string>|<stdin>)(?::\d+)?\)$")
# Interpreter and binding libraries: a leaf here is Python overhead, not compute.
_INTERPRETER = re.compile(r"\((libpython[^()]*|python3[^()/]*|libtorch_python\.so[^()]*)\)$")
_PROCESS = re.compile(r'process (\d+):"(.*?)";(?=process \d+:"|thread \()')
_THREAD = re.compile(r"^thread \((\d+|0x[0-9a-fA-F]+)\)(?::\s*(.*))?$")


def is_python_frame(frame: str) -> bool:
    return bool(_PY_FRAME.search(frame))


def native_tail(frames: list[str]) -> list[str]:
    """Frames below the innermost Python frame (all of them if there is none)."""
    for index in range(len(frames) - 1, -1, -1):
        if is_python_frame(frames[index]):
            return frames[index + 1:]
    return frames


def leaf_is_interpreter(frames: list[str]) -> bool:
    """The leaf is running Python: a Python frame, libpython or torch's Python bindings."""
    if not frames:
        return True
    return is_python_frame(frames[-1]) or bool(_INTERPRETER.search(frames[-1]))


def categorize(frames: list[str], rules: Iterable[Rule] = RULES) -> str:
    """The category of one stack (root-first frames below the thread frame)."""
    tail = native_tail(frames)
    in_forward = any(re.search(_FORWARD, f) for f in frames)
    for rule in rules:
        if rule.kind == "tail":
            if rule.exclude_regex is not None and any(rule.exclude_regex.search(f) for f in tail):
                continue
            if any(rule.regex.search(f) for f in tail):
                return rule.category
        elif rule.kind == "innermost":
            if rule.regex.search(innermost_python(frames)):
                return rule.category
        elif rule.kind == "forward":
            if not in_forward:
                continue
            if leaf_is_interpreter(frames):
                return "python_dispatch"
            if any(rule.regex.search(f) for f in frames):
                return rule.category
        elif any(rule.regex.search(f) for f in frames):
            return rule.category
    return "other"


@dataclass
class Stack:
    pid: int
    command: str
    tid: int
    thread_name: str
    frames: list[str]
    count: int


def _tid(text: str) -> int:
    return int(text, 16) if text.startswith("0x") else int(text)


def parse_raw_line(line: str) -> Stack | None:
    """One ``stack COUNT`` line of py-spy's raw output; None for a blank line."""
    line = line.rstrip("\n")
    if not line.strip():
        return None
    head, sep, count = line.rpartition(" ")
    if not sep or not count.isdigit():
        raise ValueError(f"not a py-spy raw line (no trailing count): {line[:120]!r}")
    # Command lines may contain ";" (python -c "a;b"), so process frames are matched, not split.
    pid, command, rest = None, "", head
    while True:
        process = _PROCESS.match(rest)
        if not process:
            break
        pid, command = int(process.group(1)), process.group(2)  # the innermost process wins
        rest = rest[process.end():]
    parts = rest.split(";")
    thread = _THREAD.match(parts[0])
    if pid is None or thread is None:
        raise ValueError(f"py-spy raw line without process and thread frames (need --subprocesses --threads): "
                         f"{line[:120]!r}")
    return Stack(pid=pid, command=command, tid=_tid(thread.group(1)), thread_name=(thread.group(2) or "").strip(),
                 frames=parts[1:], count=int(count))


def parse_raw(text: str) -> list[Stack]:
    return [stack for stack in map(parse_raw_line, text.splitlines()) if stack is not None]


def innermost_python(frames: list[str]) -> str:
    for frame in reversed(frames):
        if is_python_frame(frame):
            return frame
    return "<no Python frame>"


def _strip_line(frame: str) -> str:
    return re.sub(r":\d+\)$", ")", frame)


@dataclass
class ThreadProfile:
    pid: int
    tid: int
    name: str = ""
    samples: int = 0
    by_category: Counter = field(default_factory=Counter)
    # (category, innermost Python frame, leaf frame) -> samples: what a reviewer checks a rule against.
    by_site: Counter = field(default_factory=Counter)

    @property
    def busy(self) -> int:
        return self.samples - self.by_category["idle"]

    @property
    def is_main(self) -> bool:
        return self.tid == self.pid


@dataclass
class ProcessProfile:
    pid: int
    command: str
    threads: dict[int, ThreadProfile] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(t.samples for t in self.threads.values())


def attribute(stacks: Iterable[Stack], rules: Iterable[Rule] = RULES) -> dict[int, ProcessProfile]:
    """Per process and thread: samples per category and per call site."""
    rules = tuple(rules)
    processes: dict[int, ProcessProfile] = {}
    for stack in stacks:
        process = processes.setdefault(stack.pid, ProcessProfile(stack.pid, stack.command))
        if stack.command and not process.command:
            process.command = stack.command
        thread = process.threads.setdefault(stack.tid, ThreadProfile(stack.pid, stack.tid))
        if stack.thread_name and not thread.name:
            thread.name = stack.thread_name
        category = categorize(stack.frames, rules)
        thread.samples += stack.count
        thread.by_category[category] += stack.count
        leaf = _strip_line(stack.frames[-1]) if stack.frames else "<empty>"
        thread.by_site[(category, _strip_line(innermost_python(stack.frames)), leaf)] += stack.count
    return processes


def rules_table() -> list[dict[str, str]]:
    """The mapping as rows, for the report and for review."""
    rows = [{"order": str(i + 1), "category": r.category, "kind": r.kind, "pattern": r.pattern, "why": r.why,
             "unless_tail": r.exclude_tail or ""} for i, r in enumerate(RULES)]
    rows.append({"order": str(len(RULES) + 1), "category": "other", "kind": "-", "pattern": "(nothing matched)",
                 "why": CATEGORIES["other"], "unless_tail": ""})
    return rows
