"""llm_kwargs -> `vllm serve` flags for vllm-server arms, and the grid checks for server/agent workloads."""

import pytest

from vllm_omni_edge_bench.harness import runner
from vllm_omni_edge_bench.harness.grid import GridError, parse_grid
from vllm_omni_edge_bench.harness.server_args import UnmappableKwargs, server_flags
from tests.harness.conftest import grid_dict


def test_values_booleans_and_json_become_flags():
    flags = server_flags({
        "kv_cache_memory_bytes": 192 << 20, "enforce_eager": True, "enable_prefix_caching": False,
        "quantization": "cpu_int4", "max_model_len": 1024, "max_num_seqs": 16,
        "compilation_config": {"mode": 3},
    })
    assert flags == [
        "--kv-cache-memory-bytes", str(192 << 20), "--enforce-eager", "--no-enable-prefix-caching",
        "--quantization", "cpu_int4", "--max-model-len", "1024", "--max-num-seqs", "16",
        "--compilation-config", '{"mode": 3}',
    ]


def test_none_value_keeps_vllms_default():
    assert server_flags({"quantization": None}) == []


def test_unknown_kwargs_are_refused_by_name():
    with pytest.raises(UnmappableKwargs) as info:
        server_flags({"enforce_eager": True, "swap_space": 4, "hf_overrides": {"x": 1}})
    message = str(info.value)
    assert "swap_space" in message and "hf_overrides" in message and "enforce_eager;" not in message


@pytest.mark.parametrize("kwargs, named", [
    ({"enforce_eager": "yes"}, "enforce_eager (expects true or false"),
    ({"max_model_len": [512]}, "max_model_len (expects a scalar"),
    ({"compilation_config": "3"}, "compilation_config (expects a mapping"),
    ({"served_model_name": "x"}, "served_model_name (set by the harness"),
])
def test_badly_typed_or_reserved_kwargs_are_refused(kwargs, named):
    with pytest.raises(UnmappableKwargs, match=named.replace("(", r"\(")):
        server_flags(kwargs)


def _server_grid(**workload):
    data = grid_dict(workloads=[{"server": workload}])
    for arm in data["arms"]:
        arm["engine"] = "vllm-server"
    return data


def test_grid_refuses_a_server_arm_with_unmappable_kwargs():
    data = _server_grid()
    data["arms"][1]["llm_kwargs"] = {"enforce_eager": True, "swap_space": 4}
    with pytest.raises(GridError, match=r"arms\.1.*swap_space"):
        parse_grid(data)


def test_the_same_kwargs_are_fine_for_an_llm_arm():
    data = grid_dict()
    data["arms"][1]["llm_kwargs"] = {"enforce_eager": True, "swap_space": 4}
    parse_grid(data)


def test_server_workload_mix_and_label():
    grid = parse_grid(_server_grid(clients=16, requests=64, prompt_tokens_mix=[32, 128, 384], gen_tokens=128))
    workload = grid.workloads[0]
    assert workload.label == "server16x64@mix32-128-384"
    assert workload.context_tokens == 384 + 128


@pytest.mark.parametrize("workload, message", [
    ({"prompt_tokens": 64, "prompt_tokens_mix": [32]}, "not both"),
    ({"prompt_tokens_mix": []}, "prompt_tokens_mix"),
    ({"prompt_tokens_mix": [32, 0]}, "prompt_tokens_mix"),
    ({"duration_s": 0}, "duration_s"),
    ({"clients": 0}, "clients"),
    ({"max_clients": 4}, "unknown key"),
])
def test_server_workload_rejects_bad_fields(workload, message):
    with pytest.raises(GridError, match=message):
        parse_grid(_server_grid(**workload))


def test_longest_mixed_prompt_must_fit_max_model_len():
    data = _server_grid(prompt_tokens_mix=[32, 480], gen_tokens=64)
    data["arms"][0]["llm_kwargs"] = {"max_model_len": 512}
    with pytest.raises(GridError, match="needs 544 tokens of context but max_model_len is 512"):
        parse_grid(data)


def test_agent_workload_task_ids_are_checked():
    data = grid_dict(workloads=[{"agent": {"tasks": ["pick-weather", "no-such-task"]}}])
    with pytest.raises(GridError, match="no-such-task"):
        parse_grid(data)
    data = grid_dict(workloads=[{"agent": {"tasks_file": "/nonexistent/tasks.yaml"}}])
    with pytest.raises(GridError, match="does not exist"):
        parse_grid(data)
    grid = parse_grid(grid_dict(workloads=[{"agent": {"tasks": ["pick-weather", "json-person"]}}, "agent"]))
    assert [w.label for w in grid.workloads] == ["agent[2]", "agent"]


def test_server_and_agent_are_refused_for_llm_arms_before_any_pass(tmp_path):
    data = grid_dict(workloads=[{"server": {}}, "agent"])
    for arm in data["arms"]:
        arm["model"] = str(tmp_path)
    with pytest.raises(GridError) as info:
        runner.check_runnable(parse_grid(data))
    assert "workload server: not implemented for vllm passes" in str(info.value)
    assert "workload agent: not implemented for vllm passes" in str(info.value)


def test_server_arms_run_server_agent_and_timing_workloads(tmp_path):
    data = _server_grid(prompt_tokens_mix=[16, 32])
    data["workloads"] += ["cold_start", "agent", {"decode": {"gen_tokens": 16}}, {"ttft": {}}, {"prefill": {}}]
    for arm in data["arms"]:
        arm["model"] = str(tmp_path)
    runner.check_runnable(parse_grid(data))  # raises if any is refused


def test_pass_adds_served_name_and_tool_parser_only_for_agent_workloads():
    from vllm_omni_edge_bench.harness import pass_vllm_server

    spec = {"llm_kwargs": {"enforce_eager": True}, "workloads": [{"kind": "decode"}]}
    assert pass_vllm_server.server_command_flags(spec) == [
        "--enforce-eager", "--served-model-name", pass_vllm_server.SERVED_NAME, "--enable-prompt-tokens-details"]
    spec["workloads"].append({"kind": "agent"})
    flags = pass_vllm_server.server_command_flags(spec)
    assert flags[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]


def test_a_server_that_exited_makes_the_pass_raise(tmp_path):
    import types

    from vllm_omni_edge_bench.harness import pass_vllm_server

    server = types.SimpleNamespace(proc=types.SimpleNamespace(poll=lambda: None), base_url="http://x",
                                   log_path=tmp_path / "server.log", log_tail=lambda n: "EngineCore died")
    client = pass_vllm_server.ServerPass(server, bank=None)
    client.check_alive()  # alive: nothing happens
    server.proc.poll = lambda: -9
    with pytest.raises(pass_vllm_server.ServerDied, match="exit code -9"):
        client.check_alive()


def test_engine_init_time_is_read_from_vllms_own_log_line():
    from vllm_omni_edge_bench.harness.pass_vllm_server import logged_engine_init_s

    line = ("(APIServer pid=1) INFO 12-02 10:34:25 [core.py:379] init engine (profile, create kv "
            "cache, warmup model) took 3.53 s\n")
    assert logged_engine_init_s("starting\n" + line + "ready\n") == 3.53
    assert logged_engine_init_s("no such line\n") is None
    assert logged_engine_init_s(line + line) is None  # two engines: not one figure
