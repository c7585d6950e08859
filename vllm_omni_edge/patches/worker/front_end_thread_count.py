"""No warning when vLLM's front-end code sets its thread count in the model's process.

What: a ``logging.Filter`` on ``vllm.v1.worker.cpu_worker``'s logger drops its "CPU backend
doesn't allow to use `torch.set_num_threads` after the thread binding, skip it." record when
the call came through ``vllm.utils.torch_utils.set_default_torch_num_threads``: the context
manager vLLM's front-end code (renderer warm-up, audio loading, the encoder budget) uses to
change its own process's torch thread count for a while. vLLM's CPU worker still skips the
call, as before; only that message goes. A ``torch.set_num_threads`` from anywhere else (a
user's script) still warns.
Why: in vLLM's layout the front end is another process than the worker and never meets the
worker's guard. In ours (``LLM()`` in-process, the one-process server) it does: every
``LLM()`` start logged the warning (renderer warm-up), and so did every served audio request,
for a call no user made.
Verified by: tests/test_front_end_thread_count.py (the worker's own guard, called through
vLLM's context manager, logs nothing; called directly, it still warns; other records of that
logger pass; idempotent).
Remove when: vLLM's front-end code checks the thread binding before it sets a thread count
(or the CPU worker's guard stops warning for it).
"""

from __future__ import annotations

import logging
import sys

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

LOGGER = "vllm.v1.worker.cpu_worker"
MESSAGE = "doesn't allow to use `torch.set_num_threads` after the thread binding"
CALLER = ("set_default_torch_num_threads", "vllm/utils/torch_utils.py")

RECORD = PatchRecord(
    name="front_end_thread_count",
    kind=Kind.FIX,
    target=f"logger {LOGGER} (the guard CPUWorker.init_device puts on torch.set_num_threads)",
    process=Process.WORKER,  # the process that binds threads; the front end's too in our layouts
    why="In the one-process layouts vLLM's front-end code meets the CPU worker's thread-binding "
    "guard: warnings at every LLM() start and per served audio request, for no user's call.",
    verified_by="tests/test_front_end_thread_count.py",
    remove_when="vLLM's front-end code checks the thread binding before setting a thread count.",
    upstream="none found",
)


def called_from_front_end_thread_count(max_depth: int = 20) -> bool:
    """Whether vLLM's ``set_default_torch_num_threads`` is on the calling stack."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == CALLER[0] and code.co_filename.replace("\\", "/").endswith(CALLER[1]):
            return True
        frame = frame.f_back
    return False


class FrontEndThreadCountFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (MESSAGE in str(record.msg) and called_from_front_end_thread_count())


def apply() -> str:
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, FrontEndThreadCountFilter) for f in logger.filters):
        logger.addFilter(FrontEndThreadCountFilter())
    return f"{LOGGER}: the thread-binding warning is dropped for vLLM's front-end thread counts"
