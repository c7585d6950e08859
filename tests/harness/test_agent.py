"""The agent suite: the shipped task file, request construction and exact scoring on canned replies."""

import json

import pytest
import yaml

from vllm_omni_edge_bench.harness import agent


@pytest.fixture(scope="module")
def suite():
    return agent.load_suite()


def _task(suite, task_id):
    return next(t for t in suite.tasks if t.id == task_id)


def _call(name, arguments):
    return {"content": None, "tool_calls": [{"name": name, "arguments": json.dumps(arguments)}]}


def test_shipped_suite_covers_every_mode(suite):
    assert 8 <= len(suite.tasks) <= 12
    assert {t.mode for t in suite.tasks} == set(agent.MODES)
    assert len({t.category for t in suite.tasks}) >= 3


def test_required_task_request_offers_all_tools_and_describes_them(suite):
    task = _task(suite, "pick-weather")
    request = agent.request_for(task, suite, max_tokens=64)
    assert request["tool_choice"] == "required" and request["temperature"] == 0.0
    assert [t["function"]["name"] for t in request["tools"]] == task.tools
    assert "get_weather" in request["messages"][0]["content"]  # the chat template does not render tools
    assert request["messages"][-1] == {"role": "user", "content": task.prompt}


def test_named_and_json_schema_requests(suite):
    named = agent.request_for(_task(suite, "args-timer"), suite, 64)
    assert named["tool_choice"] == {"type": "function", "function": {"name": "set_timer"}}
    js = agent.request_for(_task(suite, "json-person"), suite, 64)
    assert js["response_format"]["type"] == "json_schema" and "tools" not in js
    assert js["response_format"]["json_schema"]["schema"] == _task(suite, "json-person").schema_


def test_right_call_passes(suite):
    result = agent.score(_task(suite, "pick-currency"), suite,
                         _call("convert_currency", {"amount": 50, "from_currency": "EUR", "to_currency": "USD"}))
    assert result["passed"] and all(c["ok"] for c in result["checks"])


def test_wrong_function_fails_that_check(suite):
    result = agent.score(_task(suite, "pick-timer"), suite, _call("send_email", {"to": "a", "subject": "b", "body": "c"}))
    failed = {c["check"] for c in result["checks"] if not c["ok"]}
    assert not result["passed"] and "function" in failed and "arguments_schema" not in failed


def test_arguments_invalid_for_the_schema_fail(suite):
    result = agent.score(_task(suite, "args-timer"), suite, _call("set_timer", {"minutes": 0, "colour": "red"}))
    checks = {c["check"]: c for c in result["checks"]}
    assert not checks["arguments_schema"]["ok"] and "minimum" in checks["arguments_schema"]["detail"]
    assert not result["passed"]


def test_wrong_value_fails_and_says_which(suite):
    result = agent.score(_task(suite, "args-weather"), suite, _call("get_weather", {"city": "Madrid", "unit": "celsius"}))
    checks = {c["check"]: c for c in result["checks"]}
    assert checks["arguments_schema"]["ok"] and not checks["argument_values"]["ok"]
    assert "unit: expected 'fahrenheit', got 'celsius'" in checks["argument_values"]["detail"]


def test_truncated_arguments_and_no_call_fail(suite):
    task = _task(suite, "args-timer")
    truncated = {"content": None, "tool_calls": [{"name": "set_timer", "arguments": '{"minutes": 4'}]}
    assert [c["ok"] for c in agent.score(task, suite, truncated)["checks"]] == [True, True, False]
    result = agent.score(task, suite, {"content": "I cannot set timers.", "tool_calls": []})
    assert not result["passed"] and result["checks"][0]["check"] == "tool_call"


def test_json_schema_tasks(suite):
    task = _task(suite, "json-person")
    good = {"content": json.dumps({"name": "Ada Lovelace", "birth_year": 1815, "city": "London"})}
    assert agent.score(task, suite, good)["passed"]
    wrong_type = {"content": json.dumps({"name": "Ada Lovelace", "birth_year": "1815", "city": "London"})}
    checks = {c["check"]: c["ok"] for c in agent.score(task, suite, wrong_type)["checks"]}
    assert checks == {"json": True, "schema": False, "values": False}
    not_json = {"content": '{"name": "Ada'}
    assert [c["check"] for c in agent.score(task, suite, not_json)["checks"]] == ["json"]
    # A boolean is not the integer 1, even though True == 1 in Python.
    task = _task(suite, "json-event")
    almost = {"title": "t", "date": "2024-05-14", "start": "09:30", "duration_minutes": 60}
    assert agent.score(task, suite, {"content": json.dumps(almost)})["passed"]
    shopping = _task(suite, "json-shopping")
    two = {"items": [{"name": "apple", "quantity": 1}, {"name": "pear", "quantity": 2}]}
    assert not agent.score(shopping, suite, {"content": json.dumps(two)})["passed"]


def test_boolean_is_not_a_number_in_expected_values():
    ok, detail = agent._values_match({"n": 1}, {"n": True})
    assert not ok and "n: expected 1" in detail


def test_figures_overall_and_per_category():
    results = [{"category": "a", "passed": True}, {"category": "a", "passed": False},
               {"category": "b", "passed": False}, {"category": "b", "passed": False}]
    figures = agent.agent_figures("agent", results)
    assert figures["agent score"]["value"] == 0.25 and figures["agent score"]["better"] == "higher"
    assert figures["agent score a"]["value"] == 0.5 and figures["agent score b"]["value"] == 0.0
    assert "1/4" in figures["agent score"]["source"]


def _write(tmp_path, data):
    path = tmp_path / "tasks.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _base():
    return yaml.safe_load(agent.DEFAULT_TASKS_FILE.read_text())


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["tasks"][0].update(tools=["get_weather", "fly"]), "unknown tools"),
    (lambda d: d["tasks"][4]["expect"].update(function="set_timer"), "expect.function must be one of"),
    (lambda d: d["tasks"][0]["expect"]["arguments"].update(unit="kelvin"), "expected unit='kelvin' is not valid"),
    (lambda d: d["tasks"][0]["expect"]["arguments"].update(country="NO"), "expected key 'country' is not in the schema"),
    (lambda d: d["tasks"][1].update(id=d["tasks"][0]["id"]), "is repeated"),
    (lambda d: d["tools"]["set_timer"]["parameters"].update(type="objekt"), "not a valid JSON schema"),
    (lambda d: d["tasks"][0].update(mode="auto"), "mode"),
    (lambda d: d["tasks"][0].update(colour="red"), "colour"),
])
def test_broken_task_files_are_refused_naming_the_problem(tmp_path, mutate, message):
    data = _base()
    mutate(data)
    with pytest.raises(agent.AgentSuiteError, match=message):
        agent.load_suite(_write(tmp_path, data))


def test_selecting_unknown_ids_is_refused(suite):
    assert [t.id for t in suite.select(["json-person", "pick-timer"])] == ["json-person", "pick-timer"]
    with pytest.raises(agent.AgentSuiteError, match="nope"):
        suite.select(["nope"])
