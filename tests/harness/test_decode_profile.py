"""decode_profile: py-spy raw stacks -> categories, on synthetic stacks shaped like py-spy's output."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from vllm_omni_edge_bench.harness import decode_profile
from vllm_omni_edge_bench.harness.stack_categories import (
    CATEGORIES,
    RULES,
    Rule,
    attribute,
    categorize,
    native_tail,
    parse_raw,
    parse_raw_line,
    rules_table,
)

# Call paths as py-spy prints them (package-relative paths, native frames with their library).
WORKER_LOOP = [
    "0x7f00 (libc.so.6)",
    "<module> (<string>:1)",
    "worker_main (vllm/v1/executor/multiproc_executor.py:700)",
    "worker_busy_loop (vllm/v1/executor/multiproc_executor.py:820)",
]
EXECUTE = WORKER_LOOP + [
    "execute_model (vllm/v1/worker/cpu_worker.py:180)",
    "execute_model (vllm/v1/worker/gpu_model_runner.py:3100)",
]
FORWARD = EXECUTE + [
    "_model_forward (vllm/v1/worker/gpu_model_runner.py:2900)",
    "_call_impl (torch/nn/modules/module.py:1784)",
    "forward (vllm/model_executor/models/llama.py:400)",
    "forward (vllm/model_executor/models/llama.py:320)",
]
LINEAR = FORWARD + [
    "forward (vllm/model_executor/layers/linear.py:560)",
    "apply (vllm_omni_edge/quantization/linear.py:90)",
    "apply (vllm_omni_edge/quantization/kernels/int4pack.py:81)",
    "__call__ (torch/_ops.py:1255)",
]
INT4PACK_NATIVE = ["torch::autograd::THPVariable__weight_int4pack_mm_for_cpu (libtorch_python.so)",
                   "at::_ops::_weight_int4pack_mm_for_cpu::call (libtorch_cpu.so)",
                   "at::native::_weight_int4pack_mm_cpu (libtorch_cpu.so)",
                   "at::native::(anonymous namespace)::weight_to_int4pack_kernel (libtorch_cpu.so)"]
ATTENTION = FORWARD + [
    "forward (vllm/model_executor/layers/attention/attention.py:450)",
    "forward (vllm/v1/attention/backends/cpu_attn.py:300)",
]
ENGINE_LOOP = [
    "<module> (<string>:1)",
    "run_engine_core (vllm/v1/engine/core.py:1300)",
    "run_busy_loop (vllm/v1/engine/core.py:1410)",
    "_process_engine_step (vllm/v1/engine/core.py:1464)",
    "step (vllm/v1/engine/core.py:600)",
]
SHM_READ = ["dequeue (vllm/distributed/device_communicators/shm_broadcast.py:890)",
            "acquire_read (vllm/distributed/device_communicators/shm_broadcast.py:794)",
            "wait (vllm/distributed/device_communicators/shm_broadcast.py:204)"]


@pytest.mark.parametrize("frames, expected", [
    # The linear kernel in native code; the same stack with the leaf in Python or its bindings is dispatch.
    (LINEAR + INT4PACK_NATIVE, "linear"),
    (LINEAR, "python_dispatch"),
    (LINEAR + INT4PACK_NATIVE[:1], "python_dispatch"),
    # An OpenMP barrier inside the kernel blocks on a futex, but it is the op's time, not idle.
    (LINEAR + INT4PACK_NATIVE + ["gomp_team_barrier_wait_end (libgomp.so.1)", "futex_wait (libgomp.so.1)",
                                 "syscall (libc.so.6)"], "linear"),
    # The lm head is a linear layer called from compute_logits.
    (EXECUTE + ["compute_logits (vllm/model_executor/models/llama.py:600)",
                "forward (vllm/model_executor/layers/logits_processor.py:60)",
                "apply (vllm_omni_edge/quantization/kernels/int4pack.py:81)"] + INT4PACK_NATIVE, "linear"),
    (ATTENTION + ["cpu_attention_with_kv_cache (_C.abi3.so)", "attn_kernel (_C.abi3.so)"], "attention"),
    # A decode step on our C++ decoder stack, through its wrapper or a steady step's _run: its
    # linear tiles are linear, its decode attention attention.
    (EXECUTE + ["_model_forward (vllm_omni_edge/patches/worker/decoder_stack.py:317)",
                "(anonymous namespace)::DecoderStack::forward (edge_cpu_int4-0123.so)",
                "tile_rows8<1, c10::BFloat16> (edge_cpu_int4-0123.so)"], "linear"),
    (WORKER_LOOP + ["execute_model (vllm_omni_edge/patches/worker/stack_step_inputs.py:190)",
                    "_run (vllm_omni_edge/patches/worker/stack_step_inputs.py:150)",
                    "(anonymous namespace)::DecoderStack::forward (edge_cpu_int4-0123.so)",
                    "(anonymous namespace)::attend_heads<1, c10::BFloat16> (edge_cpu_int4-0123.so)"], "attention"),
    (FORWARD + ["forward_cpu (vllm/model_executor/layers/layernorm.py:200)",
                "at::native::rms_norm (libtorch_cpu.so)"], "torch_other"),
    (FORWARD + ["forward (vllm/model_executor/layers/activation.py:80)"], "python_dispatch"),
    # The runner's input preparation, including the attention metadata builder it calls.
    (EXECUTE + ["_prepare_inputs (vllm/v1/worker/gpu_model_runner.py:1500)",
                "_build_attention_metadata (vllm/v1/worker/gpu_model_runner.py:1700)",
                "build (vllm/v1/attention/backends/cpu_attn.py:200)"], "input_prep"),
    (EXECUTE + ["_update_states (vllm/v1/worker/gpu_model_runner.py:900)"], "input_prep"),
    (WORKER_LOOP + ["sample_tokens (vllm/v1/worker/gpu_model_runner.py:3400)",
                    "_sample (vllm/v1/worker/gpu_model_runner.py:2700)",
                    "forward (vllm/v1/sample/sampler.py:90)", "at::native::argmax (libtorch_cpu.so)"], "sampling"),
    (WORKER_LOOP + ["sample_tokens (vllm/v1/worker/gpu_model_runner.py:3400)",
                    "_bookkeeping_sync (vllm/v1/worker/gpu_model_runner.py:2800)"], "runner_bookkeeping"),
    # Busy-wait on the shm ring buffer (sched_yield) vs the idle wait on its zmq notify socket.
    (WORKER_LOOP + SHM_READ + ["sched_yield (vllm/distributed/utils.py:40)", "sched_yield (libc.so.6)"], "polling"),
    (WORKER_LOOP + SHM_READ[:2] + ["check (vllm/distributed/device_communicators/shm_broadcast.py:775)"], "polling"),
    (WORKER_LOOP + SHM_READ + ["poll (zmq/sugar/poll.py:106)", "zmq_poll (libzmq.so.5)", "poll (libc.so.6)"], "idle"),
    (WORKER_LOOP + ["dequeue (vllm/distributed/device_communicators/shm_broadcast.py:895)",
                    "loads (pickle.py:1)"], "ipc"),
    (ENGINE_LOOP + ["schedule (vllm/v1/core/sched/scheduler.py:300)",
                    "allocate_slots (vllm/v1/core/kv_cache_manager.py:250)"], "scheduler"),
    (ENGINE_LOOP + ["execute_model (vllm/v1/executor/multiproc_executor.py:300)",
                    "collective_rpc (vllm/v1/executor/multiproc_executor.py:380)"], "busy_loop"),
    (["<module> (<string>:1)", "_bootstrap (threading.py:1002)", "run (threading.py:982)",
      "process_output_sockets (vllm/v1/engine/core.py:1800)", "encode (vllm/v1/serial_utils.py:120)"], "ipc"),
    # A thread blocked in queue.get: the lock wait shows as libpython then an unnamed libc frame.
    (ENGINE_LOOP[:3] + ["_process_input_queue (vllm/v1/engine/core.py:1440)", "get (queue.py:171)",
                        "wait (threading.py:327)", "PyThread_acquire_lock_timed (libpython3.11.so.1.0)",
                        "sem_clockwait (libc.so.6)", "0x7f12 (libc.so.6)"], "idle"),
    (["<module> (vllm_omni_edge_bench/harness/decode_profile.py:1)", "step (vllm/v1/engine/llm_engine.py:312)",
      "get_output (vllm/v1/engine/core_client.py:700)", "take_gil (libpython3.11.so.1.0)",
      "pthread_cond_timedwait (libc.so.6)"], "gil_wait"),
    (["<module> (vllm_omni_edge_bench/harness/decode_profile.py:1)", "step (vllm/v1/engine/llm_engine.py:319)",
      "process_outputs (vllm/v1/engine/output_processor.py:500)",
      "update_from_output (vllm/v1/engine/detokenizer.py:120)"], "output_processing"),
    (FORWARD + ["gc_collect_main (libpython3.11.so.1.0)"], "python_gc"),
    (["<module> (vllm_omni_edge_bench/harness/decode_profile.py:1)", "timed_process_outputs (vllm_omni_edge_bench/harness/"
      "decode_profile.py:101)"], "harness"),
    (["<module> (somewhere/else.py:1)", "mystery (libmystery.so)"], "other"),
    # The profiler's own frames sit below everything in the front end: they count only when innermost.
    (["<module> (vllm_omni_edge_bench/harness/decode_profile.py:1)", "mystery (somewhere/else.py:3)"], "other"),
    (["<module> (vllm_omni_edge_bench/harness/decode_profile.py:1)", "generate (vllm/entrypoints/llm.py:460)",
      "process_inputs (vllm/v1/engine/input_processor.py:300)"], "busy_loop"),
])
def test_categorize(frames, expected):
    assert categorize(frames) == expected


def test_native_tail_is_below_the_innermost_python_frame():
    frames = ["a (x.py:1)", "b (libpython3.11.so.1.0)", "c (y.py:2)", "d (libc.so.6)", "e (libc.so.6)"]
    assert native_tail(frames) == ["d (libc.so.6)", "e (libc.so.6)"]
    assert native_tail(["d (libc.so.6)"]) == ["d (libc.so.6)"]
    assert native_tail(["a (x.py:1)"]) == []


def _line(frames, pid=100, tid=None, name="MainThread", count=1, parent=None):
    head = [f'process {parent}:"python -m vllm_omni_edge_bench.harness.decode_profile --target s"'] if parent else []
    head.append(f'process {pid}:"VLLM::Worker"')
    head.append(f"thread ({tid if tid is not None else pid}): {name}" if name else f"thread ({tid or pid})")
    return ";".join(head + list(frames)) + f" {count}"


def test_parse_raw_line_takes_the_innermost_process_and_the_thread():
    stack = parse_raw_line(_line(["f (a.py:1)", "g (libc.so.6)"], pid=200, tid=201, name="Thread-1", count=7,
                                 parent=100))
    assert (stack.pid, stack.command, stack.tid, stack.thread_name, stack.count) == (200, "VLLM::Worker", 201,
                                                                                     "Thread-1", 7)
    assert stack.frames == ["f (a.py:1)", "g (libc.so.6)"]
    unnamed = parse_raw_line('process 5:"x";thread (0x1f);f (a.py:1) 2')
    assert (unnamed.tid, unnamed.thread_name, unnamed.frames) == (31, "", ["f (a.py:1)"])
    # A frame may contain spaces and semicolon-free parentheses; only the last field is the count.
    odd = parse_raw_line('process 5:"a b";thread (5): MainThread;at::native::(anonymous namespace)::k (lib.so) 3')
    assert odd.frames == ["at::native::(anonymous namespace)::k (lib.so)"] and odd.count == 3
    assert parse_raw_line("   \n") is None
    # Command lines can hold semicolons (multiprocessing starts children with python -c "a; b").
    semi = parse_raw_line('process 5:"python t.py";process 6:"python -c from x import main;main(3)";'
                          'thread (6): MainThread;f (a.py:1) 1')
    assert (semi.pid, semi.command, semi.frames) == (6, "python -c from x import main;main(3)", ["f (a.py:1)"])


@pytest.mark.parametrize("line, why", [
    ('process 5:"x";thread (5): Main;f (a.py:1)', "trailing count"),
    ("f (a.py:1);g (b.py:2) 4", "--subprocesses --threads"),
    ('process 5:"x";f (a.py:1) 4', "--subprocesses --threads"),
])
def test_parse_raw_line_names_what_is_wrong(line, why):
    with pytest.raises(ValueError, match=why):
        parse_raw_line(line)


def test_attribute_counts_every_sample_once_per_thread():
    text = "\n".join([
        _line(LINEAR + INT4PACK_NATIVE, count=30),
        _line(LINEAR, count=10),
        _line(WORKER_LOOP + SHM_READ + ["sched_yield (libc.so.6)"], count=5),
        _line(["mystery (libmystery.so)"], count=2),
        _line(["run (threading.py:982)", "poll (libc.so.6)"], tid=101, name="", count=40),
        _line(["run (threading.py:982)", "poll (libc.so.6)"], tid=101, name="Poller", count=7),
    ])
    processes = attribute(parse_raw(text))
    assert set(processes) == {100}
    main, helper = processes[100].threads[100], processes[100].threads[101]
    assert main.is_main and not helper.is_main
    assert main.samples == 47 and sum(main.by_category.values()) == 47
    assert dict(main.by_category) == {"linear": 30, "python_dispatch": 10, "polling": 5, "other": 2}
    assert helper.name == "Poller" and helper.samples == 47 and helper.busy == 0
    assert processes[100].samples == 94
    # Call sites keep the innermost Python frame without its line number.
    assert main.by_site[("linear", "__call__ (torch/_ops.py)", INT4PACK_NATIVE[-1])] == 30


def test_rules_cover_every_category_and_refuse_unknown_ones():
    ruled = {rule.category for rule in RULES}
    assert ruled | {"python_dispatch", "other"} == set(CATEGORIES)
    assert [row["category"] for row in rules_table()][-1] == "other"
    with pytest.raises(ValueError, match="unknown category"):
        Rule("kernels", "any", "x", "why")
    with pytest.raises(ValueError, match="kind"):
        Rule("linear", "leafish", "x", "why")


def test_window_stats_split_profiled_and_unprofiled_decode():
    # Request 0: 10 tokens 0.1 s apart from t=0; request 1 starts at t=1.5 (its first step carries the prefill).
    steps = [[0.1 * i, 1, 0] for i in range(10)] + [[1.5 + 0.05 * i, 1, 1] for i in range(10)]
    stats = decode_profile.window_stats(steps, (0.25, 1.75))
    assert stats["tokens"] == 7 + 6  # t=0.3..0.9 and 1.5..1.75
    assert stats["ms_per_token"] == pytest.approx(1000 * 1.5 / 13)
    assert stats["requests_started"] == 1
    assert stats["decode_interval_in_window"]["n"] == 6 + 5
    assert stats["decode_interval_in_window"]["mean_ms"] == pytest.approx((6 * 100 + 5 * 50) / 11)
    assert stats["decode_interval_unprofiled"]["mean_ms"] == pytest.approx((3 * 100 + 4 * 50) / 7)
    assert stats["covered"]
    assert not decode_profile.window_stats(steps, (0.25, 5.0))["covered"]


def _record(processes, ms_per_token=50.0):
    profile = decode_profile.summarise(processes, root_pid=100, roles={}, ms_per_token=ms_per_token)
    return {
        "model_name": "default:cpu_int4", "layout": "three", "spec": {"gen_tokens": 256},
        "window": {"ms_per_token": ms_per_token, "tokens": 300, "window_s": 15.0, "requests_started": 1,
                   "decode_interval_in_window": {"mean_ms": 49.0, "n": 290},
                   "decode_interval_unprofiled": {"mean_ms": 45.0, "n": 100}},
        "pyspy": {"version": "py-spy 0.4.2", "rate_hz": 100, "summary": "Samples: 100 Errors: 0",
                  "window_from": "py-spy's output lines"},
        "load_average_before": [0.1, 0.1, 0.1], "load_average_after": [1.0, 1.0, 1.0],
        "profile": profile, "unmatched": decode_profile.unmatched_sites(processes), "rules": rules_table(),
        "problems": [], "env_overlay": {},
        "provenance": {"command": ["python", "-m", "x"], "git": {"sha": "abc", "dirty": False}},
    }


def test_summary_columns_add_up_to_the_token_wall_time():
    text = "\n".join([
        _line(["<module> (vllm_omni_edge_bench/harness/decode_profile.py:1)", "get (queue.py:171)",
               "sem_clockwait (libc.so.6)"], pid=100, count=90, name="MainThread"),
        _line(["<module> (vllm_omni_edge_bench/harness/decode_profile.py:1)",
               "process_outputs (vllm/v1/engine/output_processor.py:500)"], pid=100, count=10),
        _line(LINEAR + INT4PACK_NATIVE, pid=300, count=60),
        _line(ATTENTION + ["attn_kernel (_C.abi3.so)"], pid=300, count=15),
        _line(WORKER_LOOP + SHM_READ + ["sched_yield (libc.so.6)"], pid=300, count=25),
        _line(["mystery (libmystery.so)"], pid=300, tid=301, name="Helper", count=100),
    ])
    processes = attribute(parse_raw(text))
    record = _record(processes)
    by_pid = {p["pid"]: p for p in record["profile"]["processes"]}
    assert by_pid[100]["role"] == "frontend" and by_pid[300]["role"] == "worker"
    for process in by_pid.values():
        for thread in process["threads"]:
            assert sum(thread["ms_per_token"].values()) == pytest.approx(50.0)
    worker_main = by_pid[300]["threads"][0]
    assert worker_main["main"] and worker_main["ms_per_token"]["linear"] == pytest.approx(30.0)
    markdown = decode_profile.render_markdown(record)
    assert "| forward: linear | 0.0 | 30.0 |" in markdown
    assert "| polling | 0.0 | 12.5 |" in markdown
    assert "| **total** | **50.0** | **50.0** |" in markdown
    assert "Helper" in markdown and "mystery" in markdown  # the other thread and the unmatched frame are shown
    json.dumps(record)  # the artifact is plain JSON


def _args(**overrides):
    args = decode_profile.build_parser().parse_args([])
    args.argv = ["-m", "vllm_omni_edge_bench.harness.decode_profile"]
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_profile_refuses_bad_input_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_profile, "find_pyspy", lambda: "/bin/true")
    with pytest.raises(decode_profile.ProfileError, match="does not exist"):
        decode_profile.profile(_args(model=str(tmp_path / "no-such-model")), tmp_path)
    (tmp_path / "model").mkdir()
    with pytest.raises(decode_profile.ProfileError, match="NAME=VALUE"):
        decode_profile.profile(_args(model=str(tmp_path / "model"), env=["JUSTANAME"]), tmp_path / "work")


def test_missing_pyspy_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(decode_profile.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(decode_profile.shutil, "which", lambda name: None)
    with pytest.raises(decode_profile.ProfileError, match="py-spy==0.4.2"):
        decode_profile.find_pyspy()


def test_cli_rejects_nonsense_settings(capsys):
    with pytest.raises(SystemExit):
        decode_profile.main(["--duration", "0"])
    assert "--duration must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        decode_profile.main(["--layout", "four"])


def test_layouts_set_the_documented_variables():
    assert decode_profile.LAYOUTS["three"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # LLM() is in-process unless asked
    assert decode_profile.LAYOUTS["inproc"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert isinstance(decode_profile.build_parser(), argparse.ArgumentParser)


def _pyspy_can_attach() -> str | None:
    """Why py-spy cannot sample a child here, or None if it can."""
    try:
        decode_profile.find_pyspy()
    except decode_profile.ProfileError as error:
        return str(error)
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if os.geteuid() != 0 and scope.exists() and scope.read_text().strip() not in ("0", "1"):
        return f"ptrace_scope {scope.read_text().strip()} forbids attaching"
    return None


def test_orchestration_samples_a_whole_fake_tree(tmp_path, monkeypatch):
    """The real py-spy on a two-process stand-in for vLLM (tests/harness/fake_decode_target.py), ~5 s."""
    why = _pyspy_can_attach()
    if why:
        pytest.skip(f"py-spy cannot sample here: {why}")
    monkeypatch.setattr(decode_profile, "TARGET_MODULE", "tests.harness.fake_decode_target")
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "profile"
    code = decode_profile.main(["--model", str(model), "--duration", "2", "--settle", "1", "--rate", "50",
                                "--gen-tokens", "50", "--start-timeout", "60", "--out", str(out)])
    assert code == 0
    record = json.loads((out / "decode_profile.json").read_text())
    assert record["problems"] == []
    assert record["window"]["tokens"] >= decode_profile.MIN_WINDOW_TOKENS
    # The caller and its spawned child were both sampled, every sample in one category.
    pids = {p["pid"] for p in record["profile"]["processes"]}
    assert record["target"]["pid"] in pids and len(pids) >= 2
    for process in record["profile"]["processes"]:
        for thread in process["threads"]:
            assert sum(thread["samples_by_category"].values()) == thread["samples"] > 0
    assert (out / "pyspy.raw.gz").stat().st_size > 0 and not (out / "pyspy.raw").exists()
    assert "## ms per token, main thread of each process" in (out / "decode_profile.md").read_text()
    assert record["provenance"]["command"][1:3] == ["-m", "vllm_omni_edge_bench.harness.decode_profile"]
    # The window is the sampling itself, bounded by py-spy's own lines, not its launch.
    assert record["pyspy"]["window_from"] == "py-spy's output lines"
    assert 1.5 <= record["window"]["window_s"] < 10


def _window(inside_ms, outside_ms):
    return {"decode_interval_in_window": {"mean_ms": inside_ms, "n": 10},
            "decode_interval_unprofiled": {"mean_ms": outside_ms, "n": 10}}


def test_a_step_stretched_past_the_limit_is_flagged():
    warning = decode_profile.pyspy_stretch_warning(_window(126.0, 8.6))
    assert warning is not None and "14.7x" in warning and "unreliable" in warning
    assert decode_profile.pyspy_stretch_warning(_window(30.0, 15.4)) is None  # 1.9x: shares still usable
    assert decode_profile.pyspy_stretch_warning(_window(None, 8.6)) is None  # nothing to compare


def test_the_rendered_profile_says_when_pyspy_took_over():
    assert "py-spy stretched" not in decode_profile.render_markdown(_record({}))  # 49 vs 45 ms
    record = _record({}, ms_per_token=126.0)
    record["window"]["decode_interval_in_window"]["mean_ms"] = 126.0
    text = decode_profile.render_markdown(record)
    assert "py-spy stretched the decode step" in text
