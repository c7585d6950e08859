"""vLLM's engine core on a thread of the API-server process: the single-process layout.

Used by ``patches/frontend/single_process.py`` (the patch that installs it).

Design, after reading vLLM 0.30's ``v1/engine/core.py`` and ``core_client.py``:

- ``EngineCoreProc`` (the engine-core process) is already built as a busy loop
  over two ``queue.Queue`` objects. Two I/O threads move messages between those
  queues and ZMQ sockets; the loop itself never touches a socket. So the engine
  here *is* ``EngineCoreProc``'s loop (scheduling, eager aborts, utility calls,
  pause/sleep futures, drain-or-abort shutdown, ``EXECUTOR_FAILED``), with the
  sockets and handshakes left out (``ThreadedEngineCore``). Nothing of that loop
  is rewritten, so its behaviour stays vLLM's.
- The loop runs on one background thread, not stepped from the event loop: a
  decode step is tens of milliseconds of kernels that release the GIL, and on a
  background thread the event loop keeps serving HTTP, detokenizing and streaming
  while the model runs, as the API server does next to a separate engine core.
  When there is no work the loop blocks on its input queue: no polling core.
- The asyncio side (``InProcessAsyncClient``) is ``AsyncMPClient``'s contract
  without serialization: requests are preprocessed on the event loop (where
  ``EngineCoreProc``'s input thread would do it; vLLM documents that call as safe
  off the busy-loop thread) and put on the input queue; outputs are handed back
  with ``loop.call_soon_threadsafe`` into the ``asyncio.Queue`` that AsyncLLM's
  output handler reads. Engine death arrives as ``ENGINE_CORE_DEAD``, exactly as
  from the output socket, and sets ``resources.engine_dead``: ``/health`` fails and
  the server's watchdog shuts it down (exit status 1 via engine_death_exit).
- The model runs through ``UniProcExecutor`` on the engine thread. vLLM binds a
  worker's OpenMP threads through ``OMP_NUM_THREADS``/``GOMP_CPU_AFFINITY`` set
  before the worker process starts; here libgomp is already loaded, so the engine
  thread pins itself to the model's cores and sets torch's thread count before it
  builds the model (``engine.cores.model_cores``: the usable cores minus
  ``VLLM_CPU_NUM_OF_RESERVED_CPU``, the same rule as the worker gets). The front
  end's threads stay unpinned, as vLLM leaves the API server. With more than one
  model core the OpenMP team shares that core set instead of one thread per core.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

from vllm.multimodal.cache import MultiModalCacheMissError
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from vllm.v1.engine.core import EngineCore, EngineCoreProc, EngineShutdownState
from vllm.v1.engine.core_client import AsyncMPClient, EngineCoreClient, _process_utility_output
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_omni_edge.log import get_logger
from vllm_omni_edge.engine.cores import model_cores

logger = get_logger("single_process")

ENGINE_THREAD_NAME = "EdgeEngineCore"
# A shutdown that drains requests may take up to vLLM's shutdown_timeout; then this.
JOIN_MARGIN_S = 30.0


def bind_this_thread(cores: list[int] | None) -> str:
    """Pin the calling thread (and the OpenMP threads it will start) to ``cores``."""
    import torch

    if cores is None:
        return f"OpenMP binding set by the user; {torch.get_num_threads()} torch threads"
    os.sched_setaffinity(0, cores)  # Linux: pid 0 is the calling thread
    torch.set_num_threads(len(cores))
    return f"engine thread on cores {cores}, {len(cores)} torch threads"


class ThreadedEngineCore(EngineCoreProc):
    """``EngineCoreProc``'s busy loop over in-process queues: no sockets, no handshake.

    Sets what ``EngineCoreProc.__init__`` sets for a single local engine without a
    DP coordinator (0.30, core.py L1026-1100), then builds the ``EngineCore``.
    """

    def __init__(self, vllm_config, executor_class, log_stats: bool, output_queue):
        self.input_queue = queue.Queue[tuple[EngineCoreRequestType, Any]]()
        self.output_queue = output_queue  # anything with put_nowait(); see _OutputBridge
        self.engine_index = 0
        self.engines_running = False
        self.shutdown_state = EngineShutdownState.RUNNING
        self.tensor_ipc_receiver = None
        self.has_coordinator = False
        self.frontend_stats_publish_address = None
        self.publish_dp_lb_stats = False
        self.last_counts = (0, 0)
        self.addresses = None
        self.process_input_queue_block = True
        self.enable_fault_tolerance = False
        executor_fail_callback = lambda: self.input_queue.put_nowait(  # noqa: E731
            (EngineCoreRequestType.EXECUTOR_FAILED, b""))
        EngineCore.__init__(self, vllm_config, executor_class, log_stats, executor_fail_callback)

    def _send_engine_dead(self):
        self.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)


@dataclass
class InProcessResources:
    """What AsyncLLM reads from ``client.resources``."""

    engine_dead: bool = False


class _OutputBridge:
    """The engine's output queue: each item is handed to the event loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver):
        self._loop = loop
        self._deliver = deliver

    def put_nowait(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the loop is closed: the server is gone, nobody reads outputs
            pass


class InProcessAsyncClient(EngineCoreClient):
    """AsyncLLM's engine-core client for an engine running on a thread of this process."""

    def __init__(self, vllm_config, log_stats: bool):
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        self.vllm_config = vllm_config
        self.resources = InProcessResources()
        self.engine_ranks_managed = [0]
        self.client_index = 0
        self.utility_results: dict[int, asyncio.Future] = {}
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()  # AsyncLLM is built inside the server's loop
        self._bridge = _OutputBridge(self._loop, self._deliver)
        self._call_ids = iter(range(1, 1 << 62))
        self._shut_down = False

        vllm_config.parallel_config.distributed_executor_backend = "uni"
        cores = model_cores()
        self.engine: ThreadedEngineCore | None = None
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                binding = bind_this_thread(cores)
                logger.info("single process: the engine core and the model run in the API-server "
                            "process (pid %d), %s", os.getpid(), binding)
                self.engine = ThreadedEngineCore(vllm_config, UniProcExecutor, log_stats, self._bridge)
            except BaseException as exc:  # reported to the starting thread, which raises it
                failure.append(exc)
                return
            finally:
                ready.set()
            self._run_busy_loop(self.engine)

        self._thread = threading.Thread(target=run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()
        ready.wait()  # the server does not listen before the engine is built, as with an engine process
        if failure:
            raise RuntimeError("Engine core initialization failed. See root cause above.") from failure[0]

    # -- the engine thread

    def _run_busy_loop(self, engine: ThreadedEngineCore) -> None:
        """``EngineCoreProc.run_engine_core``'s error handling, for a thread."""
        try:
            engine.run_busy_loop()
        except SystemExit:
            logger.info("[shutdown] EngineCore: exiting busy loop")
        except BaseException:
            logger.exception("EngineCore encountered a fatal error.")
            engine._send_engine_dead()
        finally:
            engine.shutdown()

    # -- the event loop's side

    def _deliver(self, item) -> None:
        """Runs on the event loop: what AsyncMPClient's output task does with a message."""
        if item == EngineCoreProc.ENGINE_CORE_DEAD:
            self.resources.engine_dead = True
            self.outputs_queue.put_nowait(EngineDeadError())
            for future in self.utility_results.values():
                if not future.done():
                    future.set_exception(EngineDeadError())
            self.utility_results.clear()
            return
        _client_index, outputs = item
        if outputs.utility_output:
            _process_utility_output(outputs.utility_output, self.utility_results)
            return
        if outputs.outputs or outputs.scheduler_stats:
            self.outputs_queue.put_nowait(outputs)

    def _ensure_alive(self) -> ThreadedEngineCore:
        if self.resources.engine_dead or self.engine is None:
            raise EngineDeadError()
        return self.engine

    def _send(self, request_type: EngineCoreRequestType, request: Any) -> None:
        self._ensure_alive().input_queue.put_nowait((request_type, request))

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs = await self.outputs_queue.get()
        if isinstance(outputs, Exception):
            raise EngineDeadError(suppress_context=True) if self.resources.engine_dead else outputs
        return outputs

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        engine = self._ensure_alive()
        request.client_index = self.client_index
        # What EngineCoreProc.process_input_sockets does before queueing an ADD.
        try:
            prepared = engine.preprocess_add_request(request)
        except MultiModalCacheMissError as err:
            engine._handle_mm_cache_miss(request, err)
            return
        except Exception:
            engine._handle_request_preproc_error(request)
            return
        self._send(EngineCoreRequestType.ADD, prepared)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead and self.engine is not None:
            # Both queues, as the input thread does: freed at the next step boundary.
            self.engine.aborts_queue.put_nowait(request_ids)
            self.engine.input_queue.put_nowait((EngineCoreRequestType.ABORT, request_ids))

    async def call_utility_async(self, method: str, *args) -> Any:
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self.utility_results[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, (self.client_index, call_id, method, args))
        return await future

    # vLLM's own wrappers; each only calls self.call_utility_async.
    get_supported_tasks_async = AsyncMPClient.get_supported_tasks_async
    pause_scheduler_async = AsyncMPClient.pause_scheduler_async
    resume_scheduler_async = AsyncMPClient.resume_scheduler_async
    is_scheduler_paused_async = AsyncMPClient.is_scheduler_paused_async
    profile_async = AsyncMPClient.profile_async
    reset_mm_cache_async = AsyncMPClient.reset_mm_cache_async
    reset_prefix_cache_async = AsyncMPClient.reset_prefix_cache_async
    reset_encoder_cache_async = AsyncMPClient.reset_encoder_cache_async
    sleep_async = AsyncMPClient.sleep_async
    wake_up_async = AsyncMPClient.wake_up_async
    is_sleeping_async = AsyncMPClient.is_sleeping_async
    execute_dummy_batch_async = AsyncMPClient.execute_dummy_batch_async
    set_weight_version_async = AsyncMPClient.set_weight_version_async
    get_weight_version_async = AsyncMPClient.get_weight_version_async
    add_lora_async = AsyncMPClient.add_lora_async
    remove_lora_async = AsyncMPClient.remove_lora_async
    list_loras_async = AsyncMPClient.list_loras_async
    pin_lora_async = AsyncMPClient.pin_lora_async
    save_sharded_state_async = AsyncMPClient.save_sharded_state_async
    collective_rpc_async = AsyncMPClient.collective_rpc_async

    def dp_engines_running(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        """Ask the loop to stop (drain or abort, per shutdown_timeout) and wait for it."""
        if self._shut_down:
            return
        self._shut_down = True
        engine = self.engine
        if engine is not None and self._thread.is_alive():
            engine.shutdown_state = EngineShutdownState.REQUESTED
            engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
            self._thread.join((timeout or 0) + JOIN_MARGIN_S)
            if self._thread.is_alive():
                logger.warning("[shutdown] the engine thread did not stop within %.0f s",
                               (timeout or 0) + JOIN_MARGIN_S)
        self.resources.engine_dead = True
