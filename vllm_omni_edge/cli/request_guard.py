"""An ASGI middleware that refuses bad request bodies before vLLM parses them.

``vllm-omni-edge serve`` adds it with vLLM's own ``--middleware`` option. It refuses,
each with one message naming the problem, in OpenAI's error shape:

- a body larger than ``VLLM_OMNI_EDGE_MAX_REQUEST_BYTES`` (default 8 MiB): 413, decided
  from ``Content-Length`` before a byte is read, or as soon as a chunked body passes
  the limit, so a huge body is never buffered whole;
- a JSON body that is not UTF-8 (RFC 8259 requires it): 400 naming the byte and
  offset. Without this, FastAPI answers only "There was an error parsing the body";
- a tool whose JSON Schema (``parameters`` or ``input_schema``) is not valid JSON
  Schema: 400 naming the tool. vLLM passes such a schema to the chat template
  unchecked unless a tool parser is configured.

Everything else goes to vLLM unchanged; after the body is replayed, ``receive`` is the
server's own, so vLLM still sees a client disconnect and aborts the request.
"""

from __future__ import annotations

import json
from typing import Any

from vllm_omni_edge import envs

MAX_REQUEST_BYTES_ENV = "VLLM_OMNI_EDGE_MAX_REQUEST_BYTES"
DEFAULT_MAX_REQUEST_BYTES = envs.flag(MAX_REQUEST_BYTES_ENV).default


class RequestRefused(Exception):
    def __init__(self, status: int, error_type: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.error_type,
                                     "param": self.param, "code": self.status}}).encode()


def max_request_bytes(environ: dict[str, str] | None = None) -> int:
    """The body limit from the environment; a bad value is an error naming the variable."""
    return envs.get(MAX_REQUEST_BYTES_ENV, environ)


def too_large(size: int, limit: int, *, declared: bool) -> RequestRefused:
    what = f"is {size} bytes" if declared else f"passed {limit} bytes"
    return RequestRefused(
        413, "RequestTooLargeError",
        f"request body {what}; this server accepts at most {limit} bytes "
        f"(set {MAX_REQUEST_BYTES_ENV} to change the limit)",
    )


def is_json_content(content_type: str) -> bool:
    # FastAPI parses a body without a content type as JSON too.
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("", "application/json") or media.endswith("+json")


def _tool_schemas(tool: Any) -> list[tuple[str, Any]]:
    """(where, schema) for each schema a tool declares, in the OpenAI chat, OpenAI
    responses and Anthropic messages shapes."""
    if not isinstance(tool, dict):
        return []
    found = []
    function = tool.get("function")
    if isinstance(function, dict) and "parameters" in function:
        found.append(("function.parameters", function["parameters"]))
    if "parameters" in tool:
        found.append(("parameters", tool["parameters"]))
    if "input_schema" in tool:
        found.append(("input_schema", tool["input_schema"]))
    return found


def tool_schema_problem(payload: Any) -> RequestRefused | None:
    """The first tool schema that is not valid JSON Schema, as a 400."""
    import jsonschema

    tools = payload.get("tools") if isinstance(payload, dict) else None
    if not isinstance(tools, list):
        return None
    for index, tool in enumerate(tools):
        for where, schema in _tool_schemas(tool):
            # Shapes other than an object are vLLM's to refuse (its message is clear).
            if not isinstance(schema, dict):
                continue
            validator = jsonschema.validators.validator_for(
                schema, default=jsonschema.Draft202012Validator)
            try:
                validator.check_schema(schema)
            except jsonschema.SchemaError as err:
                name = (tool.get("function") or {}).get("name") or tool.get("name") or "?"
                at = "/".join(str(p) for p in err.path) or "(root)"
                return RequestRefused(
                    400, "BadRequestError",
                    f"tools[{index}].{where} (tool {name!r}) is not a valid JSON Schema: "
                    f"{err.message} (at {at})",
                    param=f"tools[{index}].{where}",
                )
    return None


def body_problem(body: bytes, content_type: str) -> RequestRefused | None:
    """What is wrong with a complete request body that vLLM would not name clearly."""
    if not body or not is_json_content(content_type):
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        return RequestRefused(
            400, "BadRequestError",
            f"request body is not valid UTF-8: byte 0x{body[err.start]:02x} at offset "
            f"{err.start}; JSON requests must be UTF-8 encoded",
        )
    if '"tools"' not in text:
        return None
    try:
        payload = json.loads(text)
    except ValueError:
        return None  # vLLM names the JSON error and its position
    return tool_schema_problem(payload)


class RequestGuard:
    """Pure ASGI middleware (no per-request task or thread); see the module docstring."""

    def __init__(self, app, max_body_bytes: int | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes or max_request_bytes()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        try:
            declared = headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                raise too_large(int(declared), self.max_body_bytes, declared=True)
            body = await self._read_body(receive)
            problem = body_problem(body, headers.get("content-type", ""))
            if problem is not None:
                raise problem
        except RequestRefused as refused:
            await self._refuse(send, refused)
            return

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large(size, self.max_body_bytes, declared=False)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    @staticmethod
    async def _refuse(send, refused: RequestRefused) -> None:
        body = refused.body()
        await send({
            "type": "http.response.start",
            "status": refused.status,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        # The rest of an oversized body is not read; end the connection.
                        (b"connection", b"close")],
        })
        await send({"type": "http.response.body", "body": body})
