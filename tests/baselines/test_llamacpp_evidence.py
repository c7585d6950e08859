"""What a llama.cpp pass records: log parsing, compiled features, the AMX default."""

from __future__ import annotations

import pytest

from vllm_omni_edge_bench.baselines.llamacpp import (
    LOG_DEBUG,
    LOG_INFO,
    LlamaCppOptions,
    LlamaLog,
    choose_extra_bufts,
    cpu_flags,
    parse_llama_log,
    parse_system_info,
)

MIB = 1 << 20

# Shaped as llama.cpp 0.3.36's format strings print them (llama-model.cpp, llama-kv-cache.cpp,
# llama-context.cpp, ggml-cpu/repack.cpp, ggml-cpu/amx/amx.cpp).
LOAD_LOG = [
    "print_info: file type   = Q4_1",
    "print_info: model type  = 135M",
    "load_tensors: loading model tensors, this can take a while... (mmap = true)",
    "load_tensors:   CPU_Mapped model buffer size =    87.60 MiB",
    "load_tensors:   CPU_REPACK model buffer size =    60.75 MiB",
    "ggml_backend_cpu_repack_buffer_set_tensor: repack tensor blk.0.attn_q.weight with q4_0_8x8",
    "ggml_backend_cpu_repack_buffer_set_tensor: repack tensor blk.0.attn_k.weight with q4_0_8x8",
    "llama_context: n_ctx         = 2048",
    "llama_context: n_batch       = 512",
    "llama_context: flash_attn    = auto",
    "llama_context:        CPU  output buffer size =     0.19 MiB",
    "llama_kv_cache:        CPU KV buffer size =    45.00 MiB",
    "llama_context:        CPU compute buffer size =    98.07 MiB",
]


def test_buffers_by_kind_and_type_in_bytes():
    parsed = parse_llama_log(LOAD_LOG)
    assert parsed["buffers"]["model"] == {"CPU_Mapped": round(87.60 * MIB), "CPU_REPACK": round(60.75 * MIB)}
    assert parsed["buffers"]["KV"] == {"CPU": 45 * MIB}
    assert parsed["buffers"]["compute"] == {"CPU": round(98.07 * MIB)}
    assert parsed["buffers"]["output"] == {"CPU": round(0.19 * MIB)}
    assert parsed["weight_buffers"] == "CPU_Mapped+CPU_REPACK"
    assert parsed["weights_mmapped"] is True and parsed["amx_weights"] is False
    assert parsed["repacked_tensors"] == 2 and parsed["repack_layouts"] == ["q4_0_8x8"]
    assert parsed["settings"]["print_info.file type"] == "Q4_1"
    assert parsed["settings"]["llama_context.n_ctx"] == "2048"
    assert parsed["settings"]["llama_context.flash_attn"] == "auto"


def test_copied_weights_and_amx_repacking_are_told_apart():
    parsed = parse_llama_log([
        "load_tensors:          CPU model buffer size =   130.00 MiB",
        "load_tensors:          AMX model buffer size =    70.00 MiB",
        "ggml_backend_amx_buffer_set_tensor: amx repack tensor blk.0.attn_q.weight of type q4_1",
    ])
    assert parsed["weights_mmapped"] is False
    assert parsed["amx_weights"] is True and parsed["amx_repacked_tensors"] == 1
    assert parsed["repacked_tensors"] == 0  # the AMX line is not counted as a CPU_REPACK one


def test_system_info_parses_into_compiled_features():
    text = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
            "AVX512 = 0 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
    features = parse_system_info(text)
    assert features["CPU"]["AVX2"] is True and features["CPU"]["AVX512"] is False
    assert features["CPU"]["REPACK"] is True
    assert "AMX_INT8" not in features["CPU"]


def test_log_capture_joins_partial_writes_and_keeps_levels():
    log = LlamaLog(echo=False)
    log.feed(LOG_INFO, "load_tensors:   CPU_Mapped model buffer")
    log.feed(LOG_INFO, " size =    87.60 MiB\nllama_context: n_ctx = 512\n")
    log.feed(LOG_DEBUG, "partial")
    assert log.lines == [(LOG_INFO, "load_tensors:   CPU_Mapped model buffer size =    87.60 MiB"),
                         (LOG_INFO, "llama_context: n_ctx = 512")]
    assert log.text()[-1] == "partial"


def test_extra_buffers_default_off_only_on_amx_cpus():
    avx2 = {"avx2", "fma", "f16c"}
    amx = avx2 | {"avx512f", "amx_tile", "amx_int8", "amx_bf16"}
    assert choose_extra_bufts(None, avx2)[0] is True
    off, why = choose_extra_bufts(None, amx)
    assert off is False and "AMX" in why
    assert choose_extra_bufts(True, amx) == (True, "set by the arm")
    assert choose_extra_bufts(False, avx2) == (False, "set by the arm")


def test_cpu_flags_read_from_cpuinfo_text():
    text = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile\nbugs\t: none\n"
    assert cpu_flags(text) == {"fpu", "avx2", "amx_tile"}
    assert cpu_flags("no flags here") == set()


def test_options_resolve_threads_and_extra_buffers(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    resolved = LlamaCppOptions(n_threads=None, use_extra_bufts=False).resolved()
    assert (resolved.n_threads, resolved.n_threads_batch, resolved.use_extra_bufts) == (2, 2, False)
    assert LlamaCppOptions(n_threads=1, n_threads_batch=2).resolved().n_threads_batch == 2


def test_struct_fields_are_set_only_if_they_exist():
    import ctypes

    from vllm_omni_edge_bench.baselines.llamacpp import LlamaCppError, set_field

    class Params(ctypes.Structure):
        _fields_ = [("load_mode", ctypes.c_int)]

    params = Params()
    set_field(params, "load_mode", 1)
    assert params.load_mode == 1
    # 0.3.36 has no use_mmap: ctypes would accept the attribute and llama.cpp never see it.
    with pytest.raises(LlamaCppError, match="no field 'use_mmap'"):
        set_field(params, "use_mmap", False)


def test_load_mode_is_recorded():
    parsed = parse_llama_log(["load_tensors: loading model tensors, this can take a while... (load_mode = none)"])
    assert parsed["settings"]["load_tensors.load_mode"] == "none"
