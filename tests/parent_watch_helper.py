"""Run as a script: spawn a child with the given process name that applies the parent
watch and sleeps, print the child's pid, then leave with ``os._exit`` (no clean-up)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time


def child(ready) -> None:
    from vllm_omni_edge.patches.worker import engine_core_parent_watch

    engine_core_parent_watch.apply()
    engine_core_parent_watch.apply()  # a second apply must not start a second thread
    threads = [t.name for t in __import__("threading").enumerate()]
    ready.put(threads.count(engine_core_parent_watch.THREAD_NAME))
    time.sleep(120)


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    proc = context.Process(target=child, args=(queue,), name=sys.argv[1])
    proc.start()
    watchers = queue.get(timeout=60)
    print(proc.pid, watchers, flush=True)
    os._exit(0)
