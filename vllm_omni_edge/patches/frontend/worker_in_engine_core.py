"""Run the model in the engine-core process: two processes instead of three (opt-in).

What: with ``VLLM_OMNI_EDGE_WORKER_IN_ENGINE=1`` and a single worker, wraps
``Executor.get_class`` (front end, before the engine core is spawned) to return
vLLM's ``UniProcExecutor`` instead of ``MultiprocExecutor``, and sets the OpenMP
thread count and binding that ``MultiprocExecutor`` would have given the worker
(``OMP_NUM_THREADS`` / ``GOMP_CPU_AFFINITY``: the usable cores minus
``VLLM_CPU_NUM_OF_RESERVED_CPU``) in the environment the engine core inherits.
Why: on CPU, vLLM turns the ``uni`` executor into ``mp`` (platforms/cpu.py, 0.30
L310-317) because a UniProc worker cannot get its OpenMP environment set. The
engine core is itself a freshly spawned process, so setting the variables before
it starts does exactly that. The third process costs a whole torch+vLLM runtime
(~600 MiB PSS measured here) and a shared-memory hop plus a polling engine core per
decode step, which on a 2-core box is a large share of a ~50 ms token.
Verified by: tests/test_patches.py (the engine core builds the model itself and its
evidence shows the binding; the layout has two processes); the harness grid
``process-layout.yaml`` measures it against the default layout.
Remove when: vLLM supports the UniProc executor on CPU in a multiprocess engine.
"""

from __future__ import annotations

import os

from vllm_omni_edge.cpu_features import usable_cores
from vllm_omni_edge.engine.cores import RESERVED_ENV, engine_thread_binding
from vllm_omni_edge.patches.base import PatchRecord, Process, wrap_method_once

ENV = "VLLM_OMNI_EDGE_WORKER_IN_ENGINE"

RECORD = PatchRecord(
    name="worker_in_engine_core",
    target="vllm.v1.executor.abstract.Executor.get_class",
    process=Process.FRONTEND,
    why="Opt-in two-process layout: the model runs in the engine core (UniProcExecutor with "
    "the OpenMP binding vLLM would give a worker), saving a process and an IPC hop per step.",
    verified_by="tests/test_patches.py (real engine: two processes, model in the engine core, "
    "binding in its evidence); harness grid process-layout.yaml.",
    remove_when="vLLM allows the UniProc executor on CPU with its thread binding.",
)


def enabled() -> bool:
    from vllm_omni_edge.levers import worker_in_engine_enabled

    return worker_in_engine_enabled()


def _bind_engine_core_threads() -> dict[str, str]:
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("GOMP_CPU_AFFINITY"):
        return {}  # the user's binding wins
    cores = sorted(os.sched_getaffinity(0))[: usable_cores()]
    binding = engine_thread_binding(cores, int(os.environ.get(RESERVED_ENV) or 0))
    os.environ.update(binding)
    return binding


def apply() -> str:
    from vllm.v1.executor.abstract import Executor

    def make_wrapper(original):
        def get_class(vllm_config):
            parallel = vllm_config.parallel_config
            if not enabled() or parallel.world_size != 1 or parallel.distributed_executor_backend != "mp":
                return original(vllm_config)
            from vllm.v1.executor.uniproc_executor import UniProcExecutor

            from vllm_omni_edge.log import get_logger

            binding = _bind_engine_core_threads()
            parallel.distributed_executor_backend = "uni"
            get_logger("layout").info(
                "%s=1: the model runs in the engine-core process (UniProcExecutor); OpenMP %s",
                ENV, binding or "binding set by the user")
            return UniProcExecutor

        return get_class

    if wrap_method_once(Executor, "get_class", make_wrapper):
        # get_class is a staticmethod; the class attribute must stay one.
        Executor.get_class = staticmethod(Executor.get_class)
    return "Executor.get_class: UniProcExecutor in the engine core when " + f"{ENV}=1"
