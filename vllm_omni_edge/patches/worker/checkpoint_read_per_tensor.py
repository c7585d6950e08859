"""Read a safetensors checkpoint tensor by tensor instead of mapping the whole file.

What: replaces vLLM's default ("lazy") safetensors weights iterator with one that parses
the file's header and reads each tensor into its own buffer (``readinto``), in the order
``safe_open`` yields them. The loader copies each tensor into its parameter and drops the
buffer, so at most one tensor is held beside the model. Other strategies ("eager",
"prefetch", "torchao", the multi-thread and fastsafetensors loaders) are left to vLLM.
Why: ``safe_open`` maps the whole file and keeps every page the loader touched mapped
until the file is closed. Those pages count in the process's PSS, so while the model
loads it holds both the file's pages and the copies in the parameters: a load-time
peak of the model's size over the steady footprint. Page-cache pages that are read,
not mapped, are not in PSS and the kernel reclaims them under pressure.
Flag: ``VLLM_OMNI_EDGE_CHECKPOINT_READ=mmap`` keeps vLLM's mapping (the lever's A/B arm).
Evidence: ``checkpoint_read`` (mode, files, tensors, bytes) in the worker evidence.
Verified by: tests/test_checkpoint_read_per_tensor.py (same names, dtypes, shapes and
values as ``safe_open`` on every dtype; no file mapping left; a truncated file is a clear
error); the grids' load-peak figures (docs/edge/results.md).
Remove when: vLLM reads safetensors without keeping the mapping (not as of 0.30.0).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Generator, Iterable

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULES = (
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.model_executor.model_loader.default_loader",
)

RECORD = PatchRecord(
    name="checkpoint_read_per_tensor",
    target="vllm.model_executor.model_loader.weight_utils.safetensors_weights_iterator "
    "(and its name in default_loader)",
    process=Process.WORKER,
    kind=Kind.LEVER,
    why="safe_open keeps the whole checkpoint mapped while loading: its pages and the "
    "parameters' copies are resident together, a load-time peak of the model's size.",
    verified_by="tests/test_checkpoint_read_per_tensor.py (identical tensors to safe_open, no "
    "mapping left, clear error on a truncated file); load-peak PSS in the user-command grids.",
    remove_when="vLLM's safetensors iterator reads instead of mapping, or releases pages as it goes.",
    upstream="none found",
)

# What the reader did in this process; read by vllm_omni_edge.evidence.
stats: dict = {"mode": None, "files": 0, "tensors": 0, "bytes": 0}


class CheckpointReadError(ValueError):
    pass


def _dtypes() -> dict:
    from safetensors.torch import _TYPES

    return _TYPES


def read_safetensors(path: str, skip=lambda name: False) -> Generator[tuple[str, "torch.Tensor"], None, None]:
    """Yield ``(name, tensor)`` for every tensor of one safetensors file, each read into its
    own buffer, in ``safe_open``'s key order (sorted by name)."""
    import torch

    dtypes = _dtypes()
    with open(path, "rb", buffering=0) as f:
        size = f.seek(0, 2)
        f.seek(0)
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointReadError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CheckpointReadError(f"{path}: header of {header_len} bytes runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointReadError(f"{path}: the safetensors header is not valid JSON ({error})") from None
        header.pop("__metadata__", None)
        base = 8 + header_len
        for name in sorted(header):
            entry = header[name]
            if skip(name):
                continue
            dtype = dtypes.get(entry.get("dtype"))
            if dtype is None:
                raise CheckpointReadError(f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}, "
                                          f"not one of {sorted(dtypes)}")
            begin, end = entry["data_offsets"]
            shape = list(entry["shape"])
            if base + end > size:
                raise CheckpointReadError(f"{path}: tensor {name!r} ends at byte {base + end}, past the end "
                                          f"of the file ({size} bytes): the file is truncated")
            buffer = torch.empty(end - begin, dtype=torch.uint8)
            if end > begin:
                f.seek(base + begin)
                got = f.readinto(memoryview(buffer.numpy()))
                if got != end - begin:
                    raise CheckpointReadError(f"{path}: read {got} of {end - begin} bytes of tensor {name!r}")
            stats["tensors"] += 1
            stats["bytes"] += end - begin
            yield name, buffer.view(dtype).reshape(shape)
    stats["files"] += 1


def apply() -> str:
    from vllm_omni_edge.levers import checkpoint_read_mode

    mode = checkpoint_read_mode()
    stats["mode"] = mode
    if mode == "mmap":
        return "VLLM_OMNI_EDGE_CHECKPOINT_READ=mmap: vLLM's safe_open mapping"
    now = [when_imported(name, _wrap) for name in TARGET_MODULES]
    return "safetensors checkpoints are read tensor by tensor" + ("" if all(now) else " (on import)")


def _wrap(module) -> None:
    original = getattr(module, "safetensors_weights_iterator")
    if getattr(original, "_vllm_omni_edge_read", False):
        return
    if module.__name__.endswith("default_loader"):
        # default_loader holds its own reference; point it at weight_utils' (wrapped) function.
        from vllm.model_executor.model_loader import weight_utils

        _wrap(weight_utils)
        module.safetensors_weights_iterator = weight_utils.safetensors_weights_iterator
        return

    def safetensors_weights_iterator(hf_weights_files: list[str], use_tqdm_on_load: bool,
                                     safetensors_load_strategy: str | None = None,
                                     local_expert_ids: set[int] | None = None, **kwargs):
        # The prefetch settings only warm the page cache (vLLM does so on network file
        # systems); reading tensor by tensor goes through the page cache as well.
        if safetensors_load_strategy not in (None, "lazy"):
            return original(hf_weights_files, use_tqdm_on_load, safetensors_load_strategy,
                            local_expert_ids, **kwargs)
        return _iterate(module, hf_weights_files, use_tqdm_on_load, local_expert_ids)

    safetensors_weights_iterator._vllm_omni_edge_read = True
    safetensors_weights_iterator.__wrapped__ = original
    module.safetensors_weights_iterator = safetensors_weights_iterator


def _iterate(weight_utils, files: Iterable[str], use_tqdm_on_load: bool, local_expert_ids):
    from tqdm import tqdm

    def skip(name: str) -> bool:
        return weight_utils.should_skip_weight(name, local_expert_ids)

    for path in tqdm(sorted(files, key=weight_utils._natural_sort_key),
                     desc="Loading safetensors checkpoint shards (read per tensor)",
                     disable=not weight_utils.enable_tqdm(use_tqdm_on_load),
                     bar_format=weight_utils._BAR_FORMAT):
        yield from read_safetensors(path, skip)
