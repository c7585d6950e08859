"""Serve from one process: the engine core and the model on a thread of the API server.

What: by default (``VLLM_OMNI_EDGE_SINGLE_PROCESS`` unset or 1; ``vllm-omni-edge serve
--multi-process``, ``VLLM_OMNI_EDGE_SINGLE_PROCESS=0`` or ``VLLM_ENABLE_V1_MULTIPROCESSING=1``
keep vLLM's layout), wraps ``EngineCoreClient.make_async_mp_client`` (what
``AsyncLLM`` calls to start its engine) to return ``InProcessAsyncClient``
(``engine/in_process.py``): vLLM's ``EngineCoreProc`` busy loop on a background
thread of this process, running the model through ``UniProcExecutor`` with the
model's cores bound on that thread. Nothing is spawned. The design and why a thread
(not stepping from the event loop) are in ``engine/in_process.py``. A configuration one
process cannot host (tensor/pipeline/data parallel, several API servers) gets vLLM's layout,
with a log line naming why, unless the user asked for one process by name: then it is refused.
Why: ``vllm serve`` on CPU runs three processes (API server, engine core, worker),
each a whole torch+vLLM runtime (~600 MiB PSS here), and pays two IPC hops plus a
polling engine core per decode step on a 2-core box. vLLM 0.30 refuses an
in-process engine under asyncio (``make_client``: "Running EngineCore in asyncio
without multiprocessing is not currently supported"), so the OpenAI server cannot
get it without this patch. Streaming, continuous batching, aborts on client
disconnect, ``/metrics`` and engine-death handling are kept (the loop is vLLM's).
Verified by: tests/e2e/test_single_process.py (one process in the server's tree,
the worker evidence from the API-server pid, a streamed chat, 4 concurrent streams
batched, KV freed after a client disconnects, an injected engine fault gives /health
503 and exit status 1); tests/test_single_process_units.py (flags, core choice).
Remove when: vLLM ships an asyncio in-process engine-core client (``make_client``
accepts ``asyncio_mode`` without multiprocessing).
"""

from __future__ import annotations


from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.engine.core_client"

RECORD = PatchRecord(
    name="single_process",
    kind=Kind.LEVER,
    target="vllm.v1.engine.core_client.EngineCoreClient.make_async_mp_client",
    process=Process.FRONTEND,
    why="The default server layout, one process: AsyncLLM's engine core and the model run on a thread of "
    "the API server (vLLM's EngineCoreProc loop over in-process queues, UniProcExecutor), "
    "saving two torch+vLLM runtimes and the IPC hops of each step.",
    verified_by="tests/e2e/test_single_process.py (one process, model in the API server, "
    "streaming, 4 concurrent clients, abort frees KV, injected engine fault: 503 and exit 1); "
    "tests/test_single_process_units.py.",
    remove_when="vLLM offers an asyncio in-process engine-core client.",
    upstream="none found",
)


class SingleProcessConfigError(ValueError):
    """The configuration needs more than one engine or worker, which one process cannot host."""


def enabled() -> bool:
    from vllm_omni_edge.levers import single_process_enabled

    return single_process_enabled()


def unservable(parallel_config, client_count: int) -> list[str]:
    """What in this configuration one process cannot host (empty: it can)."""
    problems = []
    if parallel_config.world_size != 1:
        problems.append(f"world size {parallel_config.world_size} (tensor/pipeline parallel)")
    if parallel_config.data_parallel_size != 1:
        problems.append(f"data_parallel_size={parallel_config.data_parallel_size}")
    if client_count != 1:
        problems.append(f"{client_count} API server processes (--api-server-count)")
    if getattr(parallel_config, "enable_fault_tolerance", False):
        problems.append("enable_fault_tolerance")
    return problems


def check_servable(parallel_config, client_count: int) -> None:
    """Refuse, naming the setting, what a single process cannot serve."""
    problems = unservable(parallel_config, client_count)
    if problems:
        raise SingleProcessConfigError(
            "VLLM_OMNI_EDGE_SINGLE_PROCESS=1 serves one engine with one worker in the API-server "
            f"process; this configuration asks for {', '.join(problems)}. Unset the flag or drop "
            "those settings.")


def wrap_make_async_mp_client(original):
    def make_async_mp_client(vllm_config, executor_class, log_stats, client_addresses=None,
                             client_count=1, client_index=0, renderer=None):
        def vllm_layout():
            return original(vllm_config, executor_class, log_stats, client_addresses=client_addresses,
                            client_count=client_count, client_index=client_index, renderer=renderer)

        if not enabled():
            return vllm_layout()
        from vllm_omni_edge.levers import single_process_asked

        if single_process_asked():
            check_servable(vllm_config.parallel_config, client_count)
        elif problems := unservable(vllm_config.parallel_config, client_count):
            from vllm_omni_edge.log import get_logger
            from vllm_omni_edge.patches.frontend.reserved_cores import reserve_for_vllm_layout

            get_logger("single_process").info(
                "vLLM's process layout: one process cannot host %s", ", ".join(problems))
            reserve_for_vllm_layout()
            return vllm_layout()
        from vllm_omni_edge.engine.in_process import InProcessAsyncClient

        # The executor class AsyncLLM chose (MultiprocExecutor on CPU) is not used:
        # the worker runs in this process through UniProcExecutor.
        return InProcessAsyncClient(vllm_config, log_stats)

    return make_async_mp_client


def _wrap(module) -> None:
    client = module.EngineCoreClient
    if wrap_method_once(client, "make_async_mp_client", wrap_make_async_mp_client):
        # A staticmethod on the class; it must stay one.
        client.make_async_mp_client = staticmethod(client.make_async_mp_client)


def apply() -> str:
    # The client module is imported by AsyncLLM; importing it here would cost
    # every vLLM process (engine core, workers) its import for nothing.
    now = when_imported(TARGET_MODULE, _wrap)
    return ("EngineCoreClient.make_async_mp_client: in-process engine unless "
            "VLLM_OMNI_EDGE_SINGLE_PROCESS=0" + ("" if now else " (on import)"))
