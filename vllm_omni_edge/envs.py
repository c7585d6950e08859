"""Every ``VLLM_OMNI_EDGE_*`` environment variable the product reads, declared once.

Each flag is a record: name, allowed values, default, a one-line doc, its role (a lever
the harness switches for an A/B, a setting, or an internal marker one of our processes
passes to another) and the modules that act on it. Reading goes through here, and nowhere
else (tests/test_envs.py checks the package):

    from vllm_omni_edge import envs
    envs.get("VLLM_OMNI_EDGE_ROPE_CAP")   # True
    envs.VLLM_OMNI_EDGE_INT4_PREFILL      # "auto"

A flag is read from the environment on every call, not cached: a spawned engine core or
worker inherits the front end's environment, and the CLI sets some flags before vLLM
starts. Unset or blank means the default; choices are compared case-insensitively; any
other value raises ``FlagError`` naming the variable, the value and what is allowed.

``docs/edge/flags.md`` is generated from these records
(``vllm-omni-edge flags --markdown > docs/edge/flags.md``); a test keeps it current.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

PREFIX = "VLLM_OMNI_EDGE_"


class FlagError(ValueError):
    """An environment variable of ours has a value we do not understand."""


class Role(str, Enum):
    LEVER = "lever"  # switches one of our changes, so the harness can run it as an A/B
    SETTING = "setting"  # a choice the user makes (a kernel, a limit, a directory)
    INTERNAL = "internal"  # set by us (the harness, the CLI, a patch) for another process


@dataclass(frozen=True)
class Flag:
    """One variable. Subclasses say which values it takes and what they read as."""

    name: str
    doc: str
    role: Role
    modules: tuple[str, ...]  # where it acts, relative to vllm_omni_edge/

    def parse(self, text: str) -> Any:
        """The value of a stripped, non-empty setting; ValueError when it is not allowed."""
        raise NotImplementedError

    @property
    def allowed(self) -> str:
        """What the variable takes, as a reader would write it ("one of ...")."""
        raise NotImplementedError

    @property
    def default(self) -> Any:
        """The value when the variable is unset or blank."""
        raise NotImplementedError

    @property
    def default_text(self) -> str:
        """The default as the docs show it."""
        raise NotImplementedError

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        raw = (os.environ if environ is None else environ).get(self.name, "")
        text = raw.strip()
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError:
            raise FlagError(f"{self.name}={raw!r}: expected {self.allowed}") from None


@dataclass(frozen=True)
class Switch(Flag):
    """``1`` (on) or ``0`` (off): a bool."""

    on: bool = True  # the default

    def parse(self, text: str) -> bool:
        if text not in ("1", "0"):
            raise ValueError(text)
        return text == "1"

    @property
    def allowed(self) -> str:
        return "1 (on) or 0 (off)"

    @property
    def default(self) -> bool:
        return self.on

    @property
    def default_text(self) -> str:
        return "1" if self.on else "0"


@dataclass(frozen=True)
class Choice(Flag):
    """One of a few words, read lower-case. ``fallback=None``: unset means "not chosen"."""

    choices: tuple[str, ...] = ()
    fallback: str | None = None  # the default; None when unset has its own meaning (the doc says)

    def parse(self, text: str) -> str:
        value = text.lower()
        if value not in self.choices:
            raise ValueError(text)
        return value

    @property
    def allowed(self) -> str:
        return f"one of {', '.join(self.choices)}"

    @property
    def default(self) -> str | None:
        return self.fallback

    @property
    def default_text(self) -> str:
        return "unset" if self.fallback is None else self.fallback


@dataclass(frozen=True)
class Number(Flag):
    """A finite number at least ``minimum`` (above it, if ``strict``); ``integer``: an int."""

    fallback: float = 0
    minimum: float = 0
    strict: bool = False
    integer: bool = False
    unit: str = ""

    def parse(self, text: str) -> float | int:
        value = int(text) if self.integer else float(text)
        if not math.isfinite(value) or value < self.minimum or (self.strict and value == self.minimum):
            raise ValueError(text)
        return value

    @property
    def allowed(self) -> str:
        kind = "a whole number" if self.integer else "a number"
        bound = f"{'>' if self.strict else '>='} {self.minimum:g}"
        return f"{self.unit}, {kind} {bound}" if self.unit else f"{kind} {bound}"

    @property
    def default(self) -> float | int:
        return int(self.fallback) if self.integer else float(self.fallback)

    @property
    def default_text(self) -> str:
        return str(self.default) if self.integer else f"{self.default:g}"


@dataclass(frozen=True)
class Directory(Flag):
    """A directory (``~`` expanded). Unset: ``unset_means`` says what is used instead."""

    unset_means: str = "unset"

    def parse(self, text: str) -> Path:
        return Path(text).expanduser()

    @property
    def allowed(self) -> str:
        return "a directory"

    @property
    def default(self) -> None:
        return None

    @property
    def default_text(self) -> str:
        return self.unset_means


LEVER, SETTING, INTERNAL = Role.LEVER, Role.SETTING, Role.INTERNAL
FLAGS: tuple[Flag, ...] = (
    # Memory.
    Switch("VLLM_OMNI_EDGE_ROPE_CAP", "RoPE cos/sin tables cut to max_model_len (1), or vLLM's "
           "full-length tables (0)", LEVER, ("levers/rope_cap.py", "patches/worker/rope_cap.py")),
    Choice("VLLM_OMNI_EDGE_KV_DEFAULT", "KV budget when none is given: sized from what max_num_seqs "
           "requests of max_model_len need, capped (need); or vLLM's share of RAM (vllm)", LEVER,
           ("levers/kv_budget.py", "patches/frontend/kv_budget.py"), ("need", "vllm"), "need"),
    Choice("VLLM_OMNI_EDGE_KV_RESIDENT", "KV cache pages resident as blocks are first written, from "
           "a fresh zero mapping (used); or vLLM's buffer zero-filled at start (all)", LEVER,
           ("patches/worker/kv_resident_as_used.py",), ("used", "all"), "used"),
    Switch("VLLM_OMNI_EDGE_EMBED_PREPACK", "oneDNN prepacked copy of the input embedding, as vLLM "
           "makes (1); or none (0)", LEVER, ("patches/worker/embedding_prepack.py",), on=False),
    Switch("VLLM_OMNI_EDGE_IMPORT_MEMO", "transformers' import-time scans (the installed distributions' "
           "top-level names, its models' import structure) remembered across starts, keyed on the files they "
           "read (1); or scanned at every import (0)", LEVER, ("patches/common/transformers_import_memo.py",)),
    Switch("VLLM_OMNI_EDGE_LAZY_IMPORTS", "packages a CPU text model never runs (PyAV, OpenCV, "
           "scipy.signal, scipy.optimize) imported on first use, triton hidden on a CPU-only torch (1); "
           "or imported as vLLM does (0)", LEVER, ("patches/common/lazy_imports.py",)),
    Choice("VLLM_OMNI_EDGE_FP16_ON_CPU", "a float16 checkpoint with dtype auto on a CPU without "
           "float16 arithmetic runs in float32 (float32); or in float16, as vLLM chooses (float16)",
           LEVER, ("patches/frontend/fp16_as_float32.py",), ("float32", "float16"), "float32"),
    Choice("VLLM_OMNI_EDGE_CHECKPOINT_READ", "safetensors checkpoints read tensor by tensor while "
           "loading (read); or mapped whole by safe_open, as vLLM does (mmap)", LEVER,
           ("patches/worker/checkpoint_read_per_tensor.py",), ("read", "mmap"), "read"),
    Switch("VLLM_OMNI_EDGE_HEAP_TRIM", "heap freed while loading returned to the OS with glibc's "
           "malloc_trim (1); or left to glibc (0)", LEVER, ("patches/worker/heap_trim.py",)),
    Switch("VLLM_OMNI_EDGE_IDLE_TRIM", "heap freed by requests returned to the OS with glibc's "
           "malloc_trim each time the engine goes idle (1); or left to glibc (0)", LEVER,
           ("patches/worker/idle_trim.py",)),
    Switch("VLLM_OMNI_EDGE_CODE_PAGES", "clean code pages of the loaded libraries unmapped after "
           "warm-up, resident again as they run (1); or left mapped (0)", LEVER,
           ("patches/worker/startup_code_pages.py", "levers/code_pages.py")),
    # cpu_int4.
    Choice("VLLM_OMNI_EDGE_INT4_LOAD", "cpu_int4 online quantization per layer as it is loaded "
           "(layerwise); or after the whole bf16 model (whole)", LEVER, ("quantization/linear.py",),
           ("layerwise", "whole"), "layerwise"),
    Choice("VLLM_OMNI_EDGE_INT4_LAYOUTS", "cpu_int4 weights packed only (one); or packed plus a "
           "dense copy for prefill (two)", LEVER, ("quantization/kernels/base.py",), ("one", "two"), "one"),
    Choice("VLLM_OMNI_EDGE_INT4_PREFILL", "rows16 calls of 96 rows or more: a bf16 GEMM on blocks "
           "dequantized from the 4-bit layout where the CPU has AMX (auto), on any CPU (bf16), or "
           "the W4A8 tiles as decode (w4a8)", LEVER, ("quantization/kernels/w4a8_avx512.py",),
           ("auto", "bf16", "w4a8"), "auto"),
    Choice("VLLM_OMNI_EDGE_INT4_PREFILL_GEMM", "the rows16 bf16 prefill path's GEMM: the op's own AMX "
           "tiles on blocks dequantized into their k-pair layout where AMX BF16 is usable (from 32 "
           "rows; oneDNN from 384), else oneDNN's matmul (auto); or oneDNN's matmul everywhere, "
           "from 96 rows (onednn)", LEVER,
           ("quantization/kernels/w4a8_avx512.py",), ("auto", "onednn"), "auto"),
    Choice("VLLM_OMNI_EDGE_INT4_GROUP_CODES", "avx512_w4a8_rows16 layers keep each group's scale "
           "and offset as one-byte codes under bf16 factors per superblock of groups, 4.625 bits a "
           "weight at group 32 (8bit); or the stored bf16 pair, 5 bits (bf16)", LEVER,
           ("quantization/group_codes.py", "quantization/kernels/w4a8_avx512.py"), ("8bit", "bf16"), "8bit"),
    Choice("VLLM_OMNI_EDGE_INT4_KERNEL", "forces one cpu_int4 kernel for every layer (a layer it "
           "cannot run is an error); unset: the router picks per CPU class", SETTING,
           ("quantization/kernels/__init__.py",),
           ("int4pack", "amx_w4a8", "avx2_w4a8", "avx2_w4a8_rows8", "avx512_w4a8_rows16", "dequant")),
    Switch("VLLM_OMNI_EDGE_FUSED_MLP", "gated SiLU MLP as one op when both linears run "
           "avx512_w4a8_rows16 (1); or vLLM's three calls (0)", LEVER, ("patches/worker/fused_silu_mlp.py",)),
    Choice("VLLM_OMNI_EDGE_WEIGHTS_CHECK", "a cpu_int4 checkpoint's SHA-256 check once per file "
           "version: size, mtime, ctime, inode (once); or every start (always)", LEVER,
           ("quantization/manifest.py",), ("once", "always"), "once"),
    # Process layout.
    Switch("VLLM_OMNI_EDGE_SINGLE_PROCESS", "the server's engine core and model on a thread of the "
           "API server (1); or vLLM's three processes (0). Unset: 1, unless "
           "VLLM_ENABLE_V1_MULTIPROCESSING=1 or the configuration needs vLLM's layout", LEVER,
           ("patches/frontend/single_process.py", "cli/serve.py")),
    Number("VLLM_OMNI_EDGE_STREAM_CHUNK_MS", "a streamed request's tokens are sent at most this often: "
           "one that comes sooner after the last chunk goes with the next (the first and last go at "
           "once); 0 sends every step's tokens, as vLLM does. Stands down for --stream-interval", LEVER,
           ("patches/frontend/stream_chunk_time.py", "cli/serving_defaults.py"), fallback=25,
           unit="milliseconds"),
    Number("VLLM_OMNI_EDGE_SHM_SPIN_S", "seconds a shared-memory queue reader spins after a read "
           "before it blocks (vLLM's own value is 1)", LEVER, ("patches/worker/shm_reader_wait.py",),
           unit="seconds"),
    # Decode.
    Switch("VLLM_OMNI_EDGE_GRAPH_ARGS", "a compiled forward calls its graph with the argument list "
           "kept from checked calls, the per-call tensors put in (1); or dynamo's code gathers every "
           "parameter on every call (0)", LEVER, ("patches/worker/compiled_graph_args.py",)),
    Switch("VLLM_OMNI_EDGE_SLOT_MAPPING_CALL", "a step's KV slot mapping computed with one call of "
           "vLLM's C++ op (1); or through vLLM's Triton launcher, which then calls it (0)", LEVER,
           ("patches/worker/slot_mapping_call.py",)),
    Switch("VLLM_OMNI_EDGE_SAMPLER_ARGMAX", "a greedy token's argmax over the vocabulary by our "
           "row-wise argmax op, and the eager random draw as one Gumbel-max op (1); or torch.argmax "
           "and the draw in torch ops (0)", LEVER,
           ("patches/worker/sampler_argmax.py", "patches/worker/cpu_random_sample.py",
            "quantization/kernels/csrc/argmax.cpp")),
    Switch("VLLM_OMNI_EDGE_ATTENTION_CALLS", "CPU attention calls of a decoder layer with cache "
           "views kept and ops called directly (1); or vLLM's (0)", LEVER,
           ("patches/worker/cpu_attention_calls.py",)),
    Switch("VLLM_OMNI_EDGE_ATTENTION_ONE_CALL", "a decoder layer's KV write inside its attention "
           "call, one custom op (1); or vLLM's separate update (0); only with "
           "VLLM_OMNI_EDGE_ATTENTION_CALLS=1",
           LEVER, ("patches/worker/cpu_attention_calls.py",)),
    Switch("VLLM_OMNI_EDGE_DECODE_ATTENTION", "a batch of one-token queries writes its keys and "
           "values and attends in one call of our decode attention op (1); or vLLM's CPU attention "
           "op (0); only with VLLM_OMNI_EDGE_ATTENTION_CALLS=1", LEVER,
           ("patches/worker/cpu_attention_calls.py", "quantization/kernels/csrc/decode_attention.cpp")),
    Switch("VLLM_OMNI_EDGE_DECODER_STACK", "a decode step of a llama-family model it can run "
           "(cpu_int4 on avx2_w4a8_rows8 or avx512_w4a8_rows16) goes through its decoder layers in one "
           "call of our C++ decoder stack (1); or vLLM's compiled forward (0); only with "
           "VLLM_OMNI_EDGE_DECODE_ATTENTION=1", LEVER,
           ("patches/worker/decoder_stack.py", "quantization/kernels/csrc/decoder_stack.cpp")),
    Switch("VLLM_OMNI_EDGE_STACK_STEP_INPUTS", "a decode step that only moves the batch's requests on "
           "by one token, on a model the decoder stack runs, takes its inputs straight from the batch "
           "(1); or through vLLM's input preparation and attention metadata (0); only with "
           "VLLM_OMNI_EDGE_DECODER_STACK=1", LEVER, ("patches/worker/stack_step_inputs.py",)),
    Switch("VLLM_OMNI_EDGE_EAGER_SAMPLER", "random sampling (temperature > 0) drawn eagerly (1); "
           "or vLLM's inductor-compiled draw (0)", LEVER, ("patches/worker/cpu_random_sample.py",)),
    # Start-up.
    Choice("VLLM_OMNI_EDGE_STARTUP_GC", "garbage collection while serve or an engine core starts: "
           "youngest generation only, frozen before the load (young); paused, one full collection "
           "before the load (pause or 1); CPython's throughout (0)", LEVER,
           ("levers/startup_gc.py", "patches/frontend/startup_gc.py", "patches/frontend/engine_start_gc.py"),
           ("young", "1", "pause", "0"), "young"),
    Switch("VLLM_OMNI_EDGE_IMPORT_GC", "automatic collection held back (in VLLM_OMNI_EDGE_STARTUP_GC's "
           "mode) while vllm and vllm.entrypoints.llm import (1); or CPython's during the imports (0)", LEVER,
           ("patches/common/import_gc.py", "levers/startup_gc.py")),
    Switch("VLLM_OMNI_EDGE_INDUCTOR_DEFERRED", "inductor's compiler modules imported when a model compiles "
           "or loads a compiled graph (1); or when vllm imports, as vLLM does (0)", LEVER,
           ("patches/common/inductor_fallback_deferred.py", "patches/common/import_compile_lazy.py")),
    Choice("VLLM_OMNI_EDGE_COMPILE", "whether a model is compiled when you do not say: eager where our C++ "
           "decoder stack will run its decode steps, compiled elsewhere (auto); compiled (on); eager (off). "
           "--enforce-eager, or a compilation config or optimization level you give, wins", LEVER,
           ("levers/compile_choice.py", "patches/frontend/compile_choice.py"), ("auto", "on", "off"), "auto"),
    Choice("VLLM_OMNI_EDGE_COMPILE_WARMUP", "warm-up of a compiled model with 16 tokens (short); or "
           "vLLM's max_num_batched_tokens (full)", LEVER, ("patches/worker/compile_warmup_tokens.py",),
           ("short", "full"), "short"),
    Switch("VLLM_OMNI_EDGE_ISA_PROBE_MEMO", "inductor's per-ISA load probes (a child Python each) "
           "remembered across starts (1); or run every start (0)", LEVER,
           ("patches/worker/isa_probe_memo.py",)),
    Switch("VLLM_OMNI_EDGE_TORCH_KEY_MEMO", "inductor's hash of torch's Python source remembered "
           "across starts while torch's install record is unchanged (1); or hashed every compiled "
           "start (0)", LEVER, ("patches/worker/torch_key_memo.py",)),
    Switch("VLLM_OMNI_EDGE_PCH_MEMO", "the path of inductor's precompiled C++ header remembered "
           "across starts (1); or preprocessed every start (0)", LEVER,
           ("patches/worker/precompiled_header_memo.py",)),
    Choice("VLLM_OMNI_EDGE_TOKENIZER_POOL", "vLLM's renderer tokenizer pool: one deep copy up front, "
           "more only when threads use it at once (lazy); or renderer_num_workers + 1 up front (vllm)",
           LEVER, ("patches/frontend/tokenizer_pool.py",), ("lazy", "vllm"), "lazy"),
    Choice("VLLM_OMNI_EDGE_TOKENIZER_TABLES", "vLLM's tokenizers drop the Python copy of their vocabulary "
           "and merges that transformers keeps only for saving, and its cached tokenizers share one "
           "vocabulary dict (drop); or keep both, as vLLM does (keep)", LEVER,
           ("patches/frontend/tokenizer_tables.py",), ("drop", "keep"), "drop"),
    Choice("VLLM_OMNI_EDGE_TOKENIZER_LOAD", "a tokenizer directory read once per process and options, "
           "later loads answered with that tokenizer (once); or read at every load, as vLLM does (each)",
           LEVER, ("patches/frontend/tokenizer_load_once.py",), ("once", "each"), "once"),
    Choice("VLLM_OMNI_EDGE_TOKENIZER_COPIES", "a shallow copy of a vLLM cached tokenizer reuses the "
           "cache vLLM built for that tokenizer (reuse); or rebuilds it, as vLLM does (rebuild)", LEVER,
           ("patches/frontend/tokenizer_copies.py",), ("reuse", "rebuild"), "reuse"),
    Switch("VLLM_OMNI_EDGE_PROCESSOR_TOKENIZER", "the Hugging Face processors vLLM builds share the "
           "tokenizer vLLM passes them (1); or each loads its own copy, as transformers does (0)", LEVER,
           ("patches/frontend/processor_tokenizer.py",)),
    # Settings.
    # The default leaves room for the base64 audio and images of omni models.
    Number("VLLM_OMNI_EDGE_MAX_REQUEST_BYTES", "the largest request body `vllm-omni-edge serve` "
           "accepts, 8 MiB by default (a larger one gets a 413)", SETTING, ("cli/request_guard.py",),
           fallback=8 << 20, strict=True, integer=True, unit="bytes"),
    Directory("VLLM_OMNI_EDGE_CACHE", "the one directory everything we build or remember is written "
              "under: models/, gguf/, ct2/, kernels/, inductor/, verified-weights/, omni/, deploy/",
              SETTING, ("cache_paths.py",), unset_means="the user cache directory "
              "(~/.cache/vllm-omni-edge on Linux)"),
    # Internal.
    Directory("VLLM_OMNI_EDGE_EVIDENCE_DIR", "where every vLLM process that loads the plugin writes "
              "its evidence record (set by the harness for each pass)", INTERNAL,
              ("evidence.py", "patches/worker/evidence_recorder.py"), unset_means="no records"),
    Switch("VLLM_OMNI_EDGE_RESERVED_CPU_CHOSEN", "VLLM_CPU_NUM_OF_RESERVED_CPU was set by our "
           "reserved_cores patch, not the user, so a later switch of layout may change it", INTERNAL,
           ("patches/frontend/reserved_cores.py",), on=False),
)
REGISTRY: dict[str, Flag] = {flag.name: flag for flag in FLAGS}

# vLLM's own variables that switch one of our levers; documented beside ours, read by vLLM too.
VLLM_VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "unset: `LLM()` runs its engine and model in the calling "
     "process (tensor, pipeline or data parallel get vLLM's layout anyway); 1: vLLM's processes, "
     "for `LLM()` and the server", "patches/frontend/llm_in_process.py, levers/__init__.py"),
    ("VLLM_PLUGINS", "unset: `LLM()`, `vllm serve` and `vllm-omni-edge serve` leave vLLM-Omni's "
     "general plugin out for a model it does not register; set: yours",
     "plugin_selection.py, patches/frontend/omni_plugin_by_model.py"),
)


def flag(name: str) -> Flag:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered flag; declare it in vllm_omni_edge/envs.py") from None


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The flag's value from ``environ`` (default: this process's environment)."""
    return flag(name).read(environ)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """The variable holds a value (not unset, not blank), whether or not it is the default."""
    return bool((os.environ if environ is None else environ).get(flag(name).name, "").strip())


def set_env(name: str, value: bool | int | float | str | Path) -> None:
    """Set a flag for this process and the processes it starts; refused if not allowed."""
    text = ("1" if value else "0") if isinstance(value, bool) else str(value)
    flag(name).read({name: text})  # raises FlagError on a value the readers would refuse
    os.environ[name] = text


def snapshot(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ``VLLM_OMNI_EDGE_*`` variable set, as set (registered or not): for evidence."""
    return {k: v for k, v in (os.environ if environ is None else environ).items() if k.startswith(PREFIX)}


def unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """``VLLM_OMNI_EDGE_*`` variables set that nothing reads (a typo, or a removed flag)."""
    return sorted(k for k in snapshot(environ) if k not in REGISTRY)


def __getattr__(name: str) -> Any:
    if name in REGISTRY:
        return REGISTRY[name].read()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *REGISTRY])


ROLE_HEADINGS = {
    Role.LEVER: ("Levers", "Each switches one of our changes, so the harness can run it as its own "
                 "A/B; the default is what we ship."),
    Role.SETTING: ("Settings", "Choices that are yours to make."),
    Role.INTERNAL: ("Internal", "Set by the harness, the CLI or a patch for another of our processes; "
                    "listed so nothing reads an undeclared variable."),
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """docs/edge/flags.md."""
    lines = [
        "# Environment variables",
        "",
        "<!-- Generated from vllm_omni_edge/envs.py by "
        "`vllm-omni-edge flags --markdown > docs/edge/flags.md`; do not edit. -->",
        "",
        "Every `VLLM_OMNI_EDGE_*` variable the plugin reads. Unset or blank means the default; "
        "choices are case-insensitive; any other value stops with an error naming the variable, "
        "the value and what is allowed. A spawned engine core or worker inherits the variables of "
        "the process that started it. Module paths are under `vllm_omni_edge/`.",
    ]
    for role, (heading, intro) in ROLE_HEADINGS.items():
        lines += ["", f"## {heading}", "", intro, "",
                  "| variable | values | default | what | module |", "|---|---|---|---|---|"]
        for f in FLAGS:
            if f.role is role:
                lines.append(f"| `{f.name}` | {_cell(f.allowed)} | {_cell(f.default_text)} | "
                             f"{_cell(f.doc)} | {', '.join(f'`{m}`' for m in f.modules)} |")
    lines += ["", "## vLLM's own variables", "",
              "Two of vLLM's variables also switch what the plugin does.", "",
              "| variable | effect | module |", "|---|---|---|"]
    lines += [f"| `{name}` | {_cell(effect)} | {', '.join(f'`{m.strip()}`' for m in where.split(','))} |"
              for name, effect, where in VLLM_VARIABLES]
    return "\n".join(lines) + "\n"


def render_text(environ: Mapping[str, str] | None = None) -> str:
    """One line a flag: its name, and the value this environment gives it or its default."""
    out = []
    for f in FLAGS:
        if not is_set(f.name, environ):
            out.append(f"{f.name:36} {f.default_text} (default)")
            continue
        try:
            f.read(environ)
            out.append(f"{f.name:36} {(os.environ if environ is None else environ)[f.name].strip()} (set)")
        except FlagError as err:
            out.append(f"{f.name:36} BAD: {err}")
    out += [f"{name:36} set, but nothing reads it" for name in unknown(environ)]
    return "\n".join(out) + "\n"
