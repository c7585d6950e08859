"""Which kernel each cpu_int4 layer runs on, in this process (the model worker).

``kernel_counts()`` -> ``{"linear:int4pack": 210, "lm_head:int4pack": 1, "fallback": 0,
"dense_prefill_copy": 0, "group_codes": 0, "six_bit": 0}``.
"fallback" counts layers on the slow dequantize-per-call kernel, "group_codes" those whose
scales and offsets the kernel keeps as 8-bit codes (``group_codes.py``), "six_bit" those that run
6-bit codes (``int4.quantize_6bit``; a 6-bit layer whose kernel takes only 4 bits counts in neither
and is logged); layers left unquantized
(online quantization of a shape the format cannot hold) count as "<kind>:unquantized". When
every layer the config handed a method to has been processed, one INFO line summarises the
choices; a WARNING follows when the C++ kernel library is not built for this source (every
layer then runs on a slower fallback: ``kernels/native.py``).

``rows16_paths()`` -> ``{"w4a8": 5376, "bf16_gemm": 196, "amx_tiles": 140}``: calls of the rows16 ops in this
process by the path the op took (the W4A8 tiles, or the bf16 GEMM it branches to for
prefill, and of those the calls on its AMX tiles); counted by the op itself, so it holds inside
compiled graphs too.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import asdict, dataclass

from vllm_omni_edge.log import get_logger

logger = get_logger("cpu_int4")


@dataclass(frozen=True)
class LayerChoice:
    prefix: str
    kind: str  # "linear" | "lm_head"
    kernel: str  # a kernel name, or "unquantized"
    reason: str
    in_features: int
    out_features: int
    group_size: int | None
    dense_prefill_copy: bool = False  # a second, dense layout kept for prefill
    group_codes: bool = False  # scales and offsets kept as 8-bit codes (quantization/group_codes.py)
    six_bit: bool = False  # runs 6-bit codes (a top-bits plane beside the nibbles)


_lock = threading.Lock()
_expected: set[str] = set()
_choices: dict[str, LayerChoice] = {}
_summarised = False


def expect(prefix: str) -> None:
    """A layer was given a cpu_int4 method; it will report in process_weights_after_loading."""
    with _lock:
        _expected.add(prefix)


def record(choice: LayerChoice) -> None:
    global _summarised
    with _lock:
        _choices[choice.prefix] = choice
        done = bool(_expected) and _expected <= _choices.keys() and not _summarised
        if done:
            _summarised = True
    if done:
        logger.info("cpu_int4: %s", summary())
        warn_if_not_built()


def warn_if_not_built() -> bool:
    """Log a WARNING (and say True) when the C++ kernel library is missing for this source."""
    from vllm_omni_edge.quantization.kernels import native

    loaded, why = native.load_library()
    if loaded or native.NOT_BUILT not in why:
        return False
    logger.warning("cpu_int4 runs on slower fallback kernels: the C++ kernel library is %s; until it is built "
                   "and the engine restarted, these layers stay there (%s)", why, kernel_counts())
    return True


def kernel_counts() -> dict[str, int]:
    with _lock:
        counts = Counter(f"{c.kind}:{c.kernel}" for c in _choices.values())
        fallback = sum(c.kernel == "dequant" for c in _choices.values())
        dense = sum(c.dense_prefill_copy for c in _choices.values())
        codes = sum(c.group_codes for c in _choices.values())
        six_bit = sum(c.six_bit for c in _choices.values())
    return {**dict(sorted(counts.items())), "fallback": fallback, "dense_prefill_copy": dense,
            "group_codes": codes, "six_bit": six_bit}


def layer_choices() -> list[dict]:
    with _lock:
        return [asdict(c) for c in _choices.values()]


def summary() -> str:
    counts = kernel_counts()
    with _lock:
        reasons = sorted({f"{c.kernel}: {c.reason}" for c in _choices.values()})
    layers = sum(v for k, v in counts.items() if ":" in k)  # not the two totals
    return f"{layers} layers, kernels {counts}; reasons: {' | '.join(reasons)}"


def reset() -> None:
    """Forget everything (tests, or a second model in the same process)."""
    global _summarised
    with _lock:
        _expected.clear()
        _choices.clear()
        _summarised = False


def rows16_paths() -> dict[str, int]:
    """Calls of the rows16 ops by path, counted in C++; zeros if the library is not loaded."""
    import torch

    from vllm_omni_edge.quantization.kernels.native import OP_NAMESPACE

    counts = getattr(getattr(torch.ops, OP_NAMESPACE), "rows16_path_counts", None)
    try:
        w4a8, bf16_gemm, amx_tiles, onednn_packed = counts() if counts is not None else (0, 0, 0, 0)
    except (RuntimeError, AttributeError):  # namespaces resolve ops lazily
        w4a8, bf16_gemm, amx_tiles, onednn_packed = 0, 0, 0, 0
    # GEMMs of the bf16_gemm calls (a fused MLP has two): amx_tiles on the op's AMX tiles (the
    # rest on oneDNN); onednn_packed on oneDNN with the blocks dequantized into its own layout.
    return {"w4a8": int(w4a8), "bf16_gemm": int(bf16_gemm), "amx_tiles": int(amx_tiles),
            "onednn_packed": int(onednn_packed)}
