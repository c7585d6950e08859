"""user_command arms: the grid's checks, the literal LLM() call and `vllm serve` argv, and the report's marker."""

import sys
from pathlib import Path

import pytest

from vllm_omni_edge_bench.harness import pass_vllm, pass_vllm_server, runner
from vllm_omni_edge_bench.harness.grid import GridError, load_grid, parse_grid
from vllm_omni_edge_bench.harness.report import USER_MARK, load_artifacts, render_markdown
from tests.harness.conftest import grid_dict, quiet_options

GRIDS = Path(__file__).resolve().parents[2] / "vllm_omni_edge_bench" / "harness" / "grids"


def _user_grid(engine="vllm", workloads=None, **arm):
    data = grid_dict(**({"workloads": workloads} if workloads else {}))
    data["arms"][1].update(engine=engine, user_command=True, **arm)
    return data


@pytest.mark.parametrize("data, message", [
    (_user_grid(env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
     "arms.1: Value error, a user_command arm runs with no environment flags; remove env (VLLM_CPU_NUM_OF_RESERVED_CPU)"),
    (_user_grid(engine="llamacpp", llm_kwargs={}, model="default"),
     "arms.1: Value error, user_command is for engine vllm or vllm-server arms, not llamacpp"),
    (_user_grid(engine="vllm-server", workloads=["agent"]),
     "arm b: the agent workload needs extra server flags (a tool parser), so a user_command server arm cannot run it"),
])
def test_user_command_arms_refuse_what_a_user_would_not_type(data, message):
    with pytest.raises(GridError) as caught:
        parse_grid(data)
    assert message in str(caught.value)


def test_user_command_arms_that_are_plain_parse():
    assert parse_grid(_user_grid()).arm("b").user_command
    assert parse_grid(_user_grid(engine="vllm-server")).arm("b").user_command
    data = grid_dict(workloads=["agent"])
    for arm in data["arms"]:
        arm["engine"] = "vllm-server"
    assert not parse_grid(data).arm("b").user_command  # agent stays fine without user_command


def test_llm_pass_gives_llm_only_the_model_and_the_arms_kwargs():
    spec = {"model": "/ckpt", "llm_kwargs": {"quantization": "cpu_int4", "max_model_len": 512},
            "user_command": True, "arm": "b", "workloads": []}
    arguments = pass_vllm.llm_arguments(spec)
    assert arguments == {"model": "/ckpt", "quantization": "cpu_int4", "max_model_len": 512}
    assert pass_vllm.llm_command(arguments) == "LLM(model='/ckpt', quantization='cpu_int4', max_model_len=512)"


def test_server_user_command_is_the_stock_vllm_serve_with_the_arms_flags_only():
    spec = {"llm_kwargs": {"max_model_len": 512, "enforce_eager": True}, "user_command": True,
            "workloads": [{"kind": "decode"}, {"kind": "server"}]}
    assert pass_vllm_server.server_argv_prefix(spec) == [str(Path(sys.executable).parent / "vllm"), "serve"]
    assert pass_vllm_server.server_command_flags(spec) == ["--max-model-len", "512", "--enforce-eager"]
    plain = {**spec, "user_command": False}
    assert pass_vllm_server.server_argv_prefix(plain) is None  # ServerProcess's `vllm-omni-edge serve`
    assert "--served-model-name" in pass_vllm_server.server_command_flags(plain)


def test_server_process_builds_the_argv_from_the_prefix(tmp_path, monkeypatch):
    from vllm_omni_edge.cli import demo

    started = []

    class NoProcess:
        def __init__(self, cmd, **kwargs):
            started.append(cmd)
            self.args = cmd

    monkeypatch.setattr(demo.subprocess, "Popen", NoProcess)
    spec = {"llm_kwargs": {"max_model_len": 512}, "user_command": True, "workloads": []}
    server = demo.ServerProcess("/ckpt", 12345, pass_vllm_server.server_command_flags(spec), tmp_path / "log",
                                argv_prefix=pass_vllm_server.server_argv_prefix(spec))
    vllm = str(Path(sys.executable).parent / "vllm")
    assert started[-1] == [vllm, "serve", "/ckpt", "--port", "12345", "--max-model-len", "512"]
    assert pass_vllm_server.shell_command(server.proc.args) == "vllm serve /ckpt --port 12345 --max-model-len 512"
    demo.ServerProcess("/ckpt", 1, ["--x"], tmp_path / "log2")  # existing callers: unchanged
    assert started[-1] == [sys.executable, "-m", "vllm_omni_edge.cli.main", "serve", "/ckpt", "--port", "1", "--x"]


def test_shell_command_quotes_what_a_shell_would_split():
    argv = ["/venv/bin/vllm", "serve", "/my ckpt", "--compilation-config", '{"mode": 3}']
    assert pass_vllm_server.shell_command(argv) == "vllm serve '/my ckpt' --compilation-config '{\"mode\": 3}'"


def test_report_marks_user_command_arms_and_shows_their_command(tmp_path, fake_engine, monkeypatch):
    monkeypatch.setenv("VLLM_SOMETHING_INHERITED", "1")
    data = grid_dict()
    data["arms"] = [{"name": "a", "model": str(tmp_path), "llm_kwargs": {}},
                    {"name": "b", "model": str(tmp_path), "llm_kwargs": {"max_model_len": 64}, "user_command": True}]
    out = tmp_path / "results"
    runner.run_grid(parse_grid(data), "name: unit\n", out, quiet_options())
    text = render_markdown(load_artifacts(out))
    assert f"| b {USER_MARK} | tg16 (↑) |" in text and "| a | tg16 (↑) |" in text
    assert f"| b {USER_MARK} | vllm |" in text
    assert f"{USER_MARK} user_command arm: its figures come from the user's literal command" in text
    assert f"- b: `LLM(model='{tmp_path}', max_model_len=64)` (as pass 1 ran it)" in text
    assert "VLLM_SOMETHING_INHERITED" in text  # a note: the harness's own environment reached the arm
    assert "- a:" not in text


def test_report_without_user_command_arms_has_no_marker(tmp_path, fake_engine):
    data = grid_dict()
    for arm in data["arms"]:
        arm["model"] = str(tmp_path)
    out = tmp_path / "results"
    runner.run_grid(parse_grid(data), "name: unit\n", out, quiet_options())
    assert USER_MARK not in render_markdown(load_artifacts(out))


def test_example_grid_measures_the_users_commands_against_llamacpp():
    grid, _ = load_grid(GRIDS / "user-commands-default.yaml")
    users = [arm for arm in grid.arms if arm.user_command]
    assert [arm.engine for arm in users] == ["vllm", "vllm-server"]
    assert all(not arm.env and arm.expect.get("quantization") == "cpu_int4" for arm in users)
    assert grid.arm(grid.control).engine == "llamacpp" and grid.prime and grid.rotate_start
