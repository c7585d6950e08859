"""The agent suite: fixed tool-calling and JSON-schema tasks through the OpenAI chat API.

Tasks live in ``agent_tasks.yaml``. Each runs greedily through vLLM's structured
outputs (named or required ``tool_choice``, or ``response_format`` json_schema)
and is scored by exact checks only: the function called, its arguments valid
against the tool's JSON schema (``jsonschema``), expected argument values, and
schema-valid JSON for json_schema tasks. The score compares arms (bf16 vs 4-bit)
for regressions; a 135M model scores low in absolute terms.

vLLM 0.30 returns ``tool_calls`` for named/required tool_choice only when a tool
parser is configured, so the server of a pass with this workload is started
with ``--enable-auto-tool-choice --tool-call-parser pythonic`` (SERVER_FLAGS);
the SmolLM2 chat template does not render tools, so the task's tools are also
described to the model in a system message.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_TASKS_FILE = Path(__file__).resolve().parent / "agent_tasks.yaml"
SERVER_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
MODES = ("required", "named", "json_schema")
TOOLS_IN_PROMPT = "system message listing each tool's name, description and parameter schema as JSON"


class AgentSuiteError(ValueError):
    """A task file that cannot be scored, naming the task and the problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Tool(_Strict):
    description: str
    parameters: dict[str, Any]


class Expect(_Strict):
    function: Optional[str] = None
    arguments: dict[str, Any] = Field(default_factory=dict)
    values: dict[str, Any] = Field(default_factory=dict)


class Task(_Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    category: str
    mode: Literal["required", "named", "json_schema"]
    prompt: str
    tools: list[str] = Field(default_factory=list)
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    expect: Expect = Field(default_factory=Expect)

    @model_validator(mode="after")
    def _mode_fields(self) -> "Task":
        if self.mode == "json_schema":
            if self.schema_ is None or self.tools or self.expect.function or self.expect.arguments:
                raise ValueError("a json_schema task has a schema and expect.values, no tools")
        else:
            if not self.tools or self.schema_ is not None or self.expect.values:
                raise ValueError("a tool task has tools and expect.function/arguments, no schema")
            if not self.expect.function or self.expect.function not in self.tools:
                raise ValueError(f"expect.function must be one of the task's tools {self.tools}")
            if self.mode == "named" and len(self.tools) != 1:
                raise ValueError("a named task offers exactly the one tool it names")
        return self


class Suite(_Strict):
    version: int
    tools: dict[str, Tool]
    tasks: list[Task] = Field(min_length=1)

    def tool_schema(self, name: str) -> dict[str, Any]:
        return self.tools[name].parameters

    def select(self, ids: Optional[list[str]]) -> list[Task]:
        if not ids:
            return list(self.tasks)
        known = {t.id: t for t in self.tasks}
        missing = [i for i in ids if i not in known]
        if missing:
            raise AgentSuiteError(f"unknown agent task ids: {', '.join(missing)} (known: {', '.join(known)})")
        return [known[i] for i in ids]


def _validator(schema: dict[str, Any]):
    import jsonschema

    return jsonschema.Draft202012Validator(schema)


def schema_errors(schema: dict[str, Any], instance: Any) -> list[str]:
    """Every way ``instance`` violates ``schema``, as short messages; empty if valid."""
    errors = sorted(_validator(schema).iter_errors(instance), key=lambda e: list(e.path))
    return [f"{'/'.join(str(p) for p in e.path) or '<root>'}: {e.message}" for e in errors]


def _check_suite(suite: Suite) -> list[str]:
    import jsonschema

    problems = []
    for name, tool in suite.tools.items():
        try:
            jsonschema.Draft202012Validator.check_schema(tool.parameters)
        except jsonschema.SchemaError as error:
            problems.append(f"tool {name}: parameters are not a valid JSON schema: {error.message}")
    ids = [t.id for t in suite.tasks]
    problems += [f"task id {i} is repeated" for i in sorted({i for i in ids if ids.count(i) > 1})]
    for task in suite.tasks:
        unknown = [t for t in task.tools if t not in suite.tools]
        if unknown:
            problems.append(f"task {task.id}: unknown tools {unknown}")
            continue
        if task.mode == "json_schema":
            try:
                jsonschema.Draft202012Validator.check_schema(task.schema_)
            except jsonschema.SchemaError as error:
                problems.append(f"task {task.id}: schema is not a valid JSON schema: {error.message}")
                continue
            schema, expected = task.schema_, task.expect.values
        else:
            schema, expected = suite.tool_schema(task.expect.function), task.expect.arguments
        # An expected value the schema forbids could never be matched: a broken task.
        properties = schema.get("properties", {})
        for key, value in expected.items():
            if key not in properties:
                problems.append(f"task {task.id}: expected key {key!r} is not in the schema")
            elif schema_errors(properties[key], value):
                problems.append(f"task {task.id}: expected {key}={value!r} is not valid for its schema")
    return problems


def load_suite(path: Path | str = DEFAULT_TASKS_FILE) -> Suite:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise AgentSuiteError(f"agent task file {path} does not exist") from None
    except yaml.YAMLError as error:
        raise AgentSuiteError(f"{path}: not valid YAML: {error}") from None
    try:
        suite = Suite.model_validate(data)
    except ValidationError as error:
        lines = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()]
        raise AgentSuiteError(f"{path}:\n" + "\n".join(lines)) from None
    problems = _check_suite(suite)
    if problems:
        raise AgentSuiteError(f"{path}:\n" + "\n".join(problems))
    return suite


def resolve_tasks_file(name: str) -> Path:
    """A bare file name is looked up next to this module; anything else is a path."""
    path = Path(name).expanduser()
    return path if path.is_absolute() or len(path.parts) > 1 else Path(__file__).resolve().parent / path


def _openai_tool(suite: Suite, name: str) -> dict[str, Any]:
    tool = suite.tools[name]
    return {"type": "function",
            "function": {"name": name, "description": tool.description, "parameters": tool.parameters}}


def request_for(task: Task, suite: Suite, max_tokens: int) -> dict[str, Any]:
    """Keyword arguments of ``chat.completions.create`` for one task (greedy)."""
    messages = [{"role": "user", "content": task.prompt}]
    request: dict[str, Any] = {"temperature": 0.0, "max_tokens": max_tokens}
    if task.mode == "json_schema":
        system = "Reply with JSON only, matching this JSON schema:\n" + json.dumps(task.schema_)
        request["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": task.id.replace("-", "_"), "schema": task.schema_}}
    else:
        tools = [_openai_tool(suite, name) for name in task.tools]
        system = "You can call these functions:\n" + "\n".join(json.dumps(t["function"]) for t in tools)
        request["tools"] = tools
        request["tool_choice"] = ("required" if task.mode == "required"
                                  else {"type": "function", "function": {"name": task.expect.function}})
    request["messages"] = [{"role": "system", "content": system}, *messages]
    return request


def reply_of(message) -> dict[str, Any]:
    """The parts of an OpenAI chat message the checks look at, as plain data."""
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in (message.tool_calls or [])]
    return {"content": message.content, "tool_calls": calls}


def _check(name: str, ok: bool, detail: str = "") -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), "detail": detail}


def _values_match(expected: dict[str, Any], actual: Any) -> tuple[bool, str]:
    if not isinstance(actual, dict):
        return False, "not an object"
    wrong = [f"{k}: expected {v!r}, got {actual.get(k, '<missing>')!r}"
             for k, v in expected.items()
             # True == 1 in Python; a flag is not a number.
             if k not in actual or actual[k] != v or isinstance(actual[k], bool) != isinstance(v, bool)]
    return not wrong, "; ".join(wrong)


def score(task: Task, suite: Suite, reply: dict[str, Any]) -> dict[str, Any]:
    """Exact checks of one reply; the task passes if every check does."""
    checks = []
    if task.mode == "json_schema":
        content = reply.get("content") or ""
        try:
            value = json.loads(content)
            checks.append(_check("json", True))
        except json.JSONDecodeError as error:
            checks.append(_check("json", False, f"{error.msg} at {error.pos}: {content[:120]!r}"))
        else:
            errors = schema_errors(task.schema_, value)
            checks.append(_check("schema", not errors, "; ".join(errors[:3])))
            if task.expect.values:
                checks.append(_check("values", *_values_match(task.expect.values, value)))
    else:
        calls = reply.get("tool_calls") or []
        if not calls:
            checks.append(_check("tool_call", False, f"no tool call; content {str(reply.get('content'))[:120]!r}"))
        else:
            call = calls[0]  # the task asks for one action; extra calls are not scored
            checks.append(_check("tool_call", True, f"{len(calls)} call(s)"))
            checks.append(_check("function", call["name"] == task.expect.function,
                                 f"called {call['name']!r}, expected {task.expect.function!r}"))
            try:
                arguments = json.loads(call["arguments"])
                checks.append(_check("arguments_json", True))
            except (json.JSONDecodeError, TypeError) as error:
                checks.append(_check("arguments_json", False, str(error)))
            else:
                if call["name"] in suite.tools:
                    errors = schema_errors(suite.tool_schema(call["name"]), arguments)
                    checks.append(_check("arguments_schema", not errors, "; ".join(errors[:3])))
                if task.expect.arguments:
                    checks.append(_check("argument_values", *_values_match(task.expect.arguments, arguments)))
    return {"passed": all(c["ok"] for c in checks), "checks": checks}


def run_suite(base_url: str, model: str, workload: dict[str, Any], request_timeout_s: float = 300.0) -> dict[str, Any]:
    """Every selected task, one request each; HTTP failures are recorded per task."""
    import openai

    suite = load_suite(resolve_tasks_file(workload["tasks_file"]))
    tasks = suite.select(workload.get("tasks"))
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="EMPTY", timeout=request_timeout_s, max_retries=0)
    results, problems = [], []
    for task in tasks:
        request = request_for(task, suite, workload["max_tokens"])
        record: dict[str, Any] = {"id": task.id, "category": task.category, "mode": task.mode,
                                  "tool_choice": request.get("tool_choice"),
                                  "response_format": (request.get("response_format") or {}).get("type")}
        start = time.perf_counter()
        try:
            response = client.chat.completions.create(model=model, **request)
        except openai.APIError as error:
            status = getattr(error, "status_code", None)
            record.update(passed=False, error=f"{type(error).__name__} {status or ''}: {str(error)[:300]}",
                          checks=[_check("request", False, f"HTTP {status}" if status else type(error).__name__)])
            # The score would then say how the server failed, not how the model did.
            problems.append(f"agent task {task.id}: request failed ({type(error).__name__} {status or ''})")
        else:
            choice = response.choices[0]
            reply = reply_of(choice.message)
            record.update(score(task, suite, reply), reply=reply, finish_reason=choice.finish_reason,
                          completion_tokens=response.usage.completion_tokens if response.usage else None)
        record["seconds"] = time.perf_counter() - start
        results.append(record)
    return {"tasks": results, "problems": problems, "tools_in_prompt": TOOLS_IN_PROMPT,
            "tasks_file": str(resolve_tasks_file(workload["tasks_file"])), "suite_version": suite.version}


def agent_figures(label: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Fraction passed overall and per category."""
    def figure(rows: list[dict[str, Any]], what: str) -> dict[str, Any]:
        passed = sum(r["passed"] for r in rows)
        return {"value": passed / len(rows), "unit": "fraction", "better": "higher",
                "source": f"agent suite: {what} tasks passed every exact check, {passed}/{len(rows)} in this pass"}

    if not results:
        return {}
    figures = {f"{label} score": figure(results, "all")}
    for category in sorted({r["category"] for r in results}):
        rows = [r for r in results if r["category"] == category]
        figures[f"{label} score {category}"] = figure(rows, category)
    return figures
