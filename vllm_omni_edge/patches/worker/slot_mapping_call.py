"""Compute a step's KV slot mapping on CPU with one call of vLLM's C++ op.

What: wraps ``vllm.v1.worker.block_table.BlockTable.compute_slot_mapping``. On CPU without
Triton, vLLM's CPU model runner installs its C++ op (``_C.compute_slot_mapping_kernel_impl``)
as the kernel of its Triton launcher, and every step still goes through the launcher: the
arguments bound to the launcher's signature by ``inspect``, a launch plan looked up, a
keyword dictionary built, then the C++ op. When that C++ op is the installed kernel and the
table needs nothing it ignores (one block per KV block, no context parallelism), the
wrapper calls the op with the arguments the launcher would have passed; otherwise vLLM's
code runs.
Why: the launcher costs several times the op itself on every step.
Flag: ``VLLM_OMNI_EDGE_SLOT_MAPPING_CALL=0`` keeps vLLM's launcher (the A/B arm).
Verified by: tests/test_slot_mapping_call.py (the same slot mapping as vLLM's launcher for
decode and mixed batches, padding included; other tables left to vLLM; wrapped once).
Remove when: vLLM's CPU runner calls the op without the Triton launcher.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.worker.block_table"

RECORD = PatchRecord(
    name="slot_mapping_call",
    kind=Kind.LEVER,
    target="vllm.v1.worker.block_table.BlockTable.compute_slot_mapping",
    process=Process.WORKER,
    why="On CPU each step's slot mapping goes through a Triton launcher (signature binding, a "
    "launch plan, keyword arguments) to reach a C++ op that takes a fraction of that time.",
    verified_by="tests/test_slot_mapping_call.py (same mapping as vLLM's launcher, padding "
    "included; other tables to vLLM); `step_ab --levers slot_mapping_call` (docs/edge/harness.md).",
    remove_when="vLLM's CPU model runner calls its slot-mapping op without the Triton launcher.",
    upstream="none found",
)


def direct_op(module):
    """The C++ op when vLLM's CPU runner installed it as the launcher's kernel, else None."""
    import sys

    cpu_tl = sys.modules.get("vllm.utils.cpu_triton_utils")
    launcher = getattr(module, "_COMPUTE_SLOT_MAPPING_KERNEL", None)
    if cpu_tl is None or launcher is None or getattr(launcher, "kernel", None) is not cpu_tl.compute_slot_mapping_kernel:
        return None
    import torch

    return torch.ops._C.compute_slot_mapping_kernel_impl.default


def make_wrapper(module):
    def make(original):
        def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
            if (self.slot_mapping_mode != module.SlotMappingMode.TOKEN_TO_KV_SLOT
                    or self.blocks_per_kv_block != 1 or self.dcp_world_size != 1):
                return original(self, num_reqs, query_start_loc, positions)
            op = direct_op(module)
            if op is None:
                return original(self, num_reqs, query_start_loc, positions)
            op(query_start_loc, positions, self.block_table.gpu, self.slot_mapping.gpu, self.block_size)

        return compute_slot_mapping

    return make


def _wrap(module) -> None:
    wrap_method_once(module.BlockTable, "compute_slot_mapping", make_wrapper(module),
                     marker="__edge_slot_mapping_call__")


def apply() -> str:
    from vllm_omni_edge.levers import slot_mapping_call_enabled

    if not slot_mapping_call_enabled():
        return "VLLM_OMNI_EDGE_SLOT_MAPPING_CALL=0: slot mappings through vLLM's Triton launcher"
    now = when_imported(TARGET_MODULE, _wrap)
    return "slot mappings computed with one call of vLLM's C++ op" + ("" if now else " (on import)")
