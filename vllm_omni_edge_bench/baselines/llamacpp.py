"""llama.cpp through llama-cpp-python's low-level (ctypes) API, and what it really used.

The high-level ``llama_cpp.Llama`` keeps a (n_batch or n_ctx) x n_vocab float
array of scores and samples through Python; a pass measuring llama.cpp should
measure llama.cpp, so this module drives ``llama_decode`` directly and reads the
logits in place (numpy views of llama.cpp's own buffer).

Evidence: llama.cpp logs, at load, every buffer it allocated and its buffer type
(``CPU_Mapped model buffer size = ...``, ``CPU_REPACK model buffer size``,
``AMX model buffer size``, ``CPU KV buffer size``...). :class:`LlamaLog` captures
that log through ``llama_log_set``, and :func:`parse_llama_log` turns it into a
dict, so a pass records which path ran rather than which one was asked for.
``llama_print_system_info()`` says which CPU features the library was compiled
with (:func:`parse_system_info`).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

MIB = 1 << 20
# ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line's level)
LOG_DEBUG, LOG_INFO, LOG_CONT = 1, 2, 5
AMX_CPU_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}

_BUFFER_LINE = re.compile(
    r"^(?P<func>\w+):\s+(?P<buffer>\S+)\s+(?P<kind>model|KV|compute|output|RS) buffer size\s*=\s*(?P<mib>[\d.]+) MiB")
_REPACK_LINE = re.compile(r"repack tensor (?P<tensor>\S+) with (?P<layout>\S+)")
_AMX_REPACK_LINE = re.compile(r"amx repack tensor (?P<tensor>\S+) of type (?P<type>\S+)")
_KV_LINE = re.compile(r"^(?P<func>\w+):\s+(?P<key>[A-Za-z_]+)\s+=\s+(?P<value>.+?)\s*$")
# Keys of `func: key = value` lines kept as evidence, by the function that prints them.
_KEPT_SETTINGS = {
    "print_info": ("file type", "file size", "model type", "model params", "arch", "n_vocab"),
    "llama_context": ("n_ctx", "n_ctx_seq", "n_batch", "n_ubatch", "flash_attn", "causal_attn", "n_seq_max"),
}
_PRINT_INFO_LINE = re.compile(r"^print_info:\s+(?P<key>[\w ]+?)\s*=\s*(?P<value>.+?)\s*$")
_LOAD_MODE = re.compile(r"\(load_mode = (?P<mode>\w+)\)")


_INSTALLED_LOG = None  # the LlamaLog whose callback llama.cpp holds


class LlamaCppError(RuntimeError):
    """llama.cpp refused something (load, context, decode), with what it said."""


# ---------------------------------------------------------------------------
# CPU and build facts


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The ``flags`` of the first CPU in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_amx(flags: Iterable[str] | None = None) -> bool:
    return bool(set(AMX_CPU_FLAGS) & set(cpu_flags() if flags is None else flags))


def choose_extra_bufts(requested: bool | None, flags: Iterable[str] | None = None) -> tuple[bool, str]:
    """Whether to let llama.cpp use extra buffer types (repacked and AMX weights), and why.

    ``None`` means: on, except on a CPU with AMX, where llama.cpp's AMX path
    crashed on the project's box (docs/engines/llama-cpp.md, "The AMX crash").
    """
    if requested is not None:
        return requested, "set by the arm"
    if cpu_has_amx(flags):
        return False, "default off: this CPU has AMX and llama.cpp's AMX matmul segfaulted here (docs/engines/llama-cpp.md)"
    return True, "default on: no AMX on this CPU, extra buffers are llama.cpp's CPU_REPACK only"


def parse_system_info(text: str) -> dict[str, Any]:
    """``CPU : SSE3 = 1 | AVX2 = 1 | ... |`` -> {"CPU": {"SSE3": True, ...}}; values not 0/1 kept as text."""
    backends: dict[str, dict[str, Any]] = {}
    current = "?"
    for part in text.split("|"):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            current, part = (s.strip() for s in part.split(":", 1))
            backends.setdefault(current, {})
            if not part:
                continue
        if "=" not in part:
            continue
        key, value = (s.strip() for s in part.split("=", 1))
        backends.setdefault(current, {})[key] = value == "1" if value in ("0", "1") else value
    return backends


# ---------------------------------------------------------------------------
# Log capture and parsing


class LlamaLog:
    """Collects llama.cpp's (and ggml's) log lines through ``llama_log_set``; echoes INFO and above to stderr.

    The ctypes callback object is kept on the instance: if it were garbage
    collected, llama.cpp would call freed memory.
    """

    def __init__(self, echo: bool = True):
        self.lines: list[tuple[int, str]] = []
        self.echo = echo
        self._partial = ""
        self._level = LOG_INFO
        self._callback = None

    def install(self) -> "LlamaLog":
        import llama_cpp

        global _INSTALLED_LOG
        self._callback = llama_cpp.llama_log_callback(self._on_log)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))
        _INSTALLED_LOG = self  # llama.cpp's logger is global: keep the callback alive until replaced
        return self

    def _on_log(self, level: int, text: bytes, _user: Any) -> None:
        if level != LOG_CONT:
            self._level = level
        self.feed(self._level, text.decode("utf-8", errors="replace") if text else "")

    def feed(self, level: int, text: str) -> None:
        if self.echo and level >= LOG_INFO:
            sys.stderr.write(text)
        self._partial += text
        *complete, self._partial = self._partial.split("\n")
        self.lines += [(level, line) for line in complete]

    def text(self) -> list[str]:
        return [line for _, line in self.lines] + ([self._partial] if self._partial else [])


def parse_llama_log(lines: Sequence[str]) -> dict[str, Any]:
    """What llama.cpp says it allocated and ran, from its log lines.

    - ``buffers``: {"model" | "KV" | "compute" | "output": {buffer type: bytes}},
      e.g. model {"CPU_Mapped": ..., "CPU_REPACK": ...}; "CPU_Mapped" means the
      weights are read from the mmap'd file, "CPU" that they were copied to RAM.
    - ``weight_buffer_types``: the model buffer types, sorted; ``weight_buffers`` the same
      joined with "+" (e.g. "CPU_Mapped+CPU_REPACK"), for an arm's ``expect``.
    - ``amx_weights``: an AMX model buffer exists (llama.cpp's AMX path will run).
    - ``repacked_tensors`` / ``repack_layouts``: tensors ggml repacked (CPU_REPACK),
      and into which layouts (from debug lines); ``amx_repacked_tensors`` likewise for AMX.
    - ``weights_mmapped``: a CPU_Mapped model buffer exists.
    - ``settings``: selected ``key = value`` lines (file type, n_ctx, flash_attn...).
    """
    buffers: dict[str, dict[str, int]] = {}
    repacked, layouts, amx_repacked = 0, set(), 0
    settings: dict[str, str] = {}
    for raw in lines:
        line = raw.strip()
        match = _BUFFER_LINE.match(line)
        if match:
            kind = buffers.setdefault(match["kind"], {})
            kind[match["buffer"]] = kind.get(match["buffer"], 0) + round(float(match["mib"]) * MIB)
            continue
        match = _AMX_REPACK_LINE.search(line)
        if match:
            amx_repacked += 1
            continue
        match = _REPACK_LINE.search(line)
        if match:
            repacked += 1
            layouts.add(match["layout"])
            continue
        match = _LOAD_MODE.search(line)
        if match:
            settings.setdefault("load_tensors.load_mode", match["mode"])
            continue
        match = _KV_LINE.match(line) or _PRINT_INFO_LINE.match(line)
        if match:
            func = match.groupdict().get("func", "print_info")
            key = match["key"].strip()
            if key in _KEPT_SETTINGS.get(func, ()):
                settings.setdefault(f"{func}.{key}", match["value"])
    model = buffers.get("model", {})
    return {
        "buffers": buffers,
        "weight_buffer_types": sorted(model),
        "weight_buffers": "+".join(sorted(model)),  # one scalar an arm's `expect` can name exactly
        "weights_mmapped": "CPU_Mapped" in model,
        "amx_weights": "AMX" in model,
        "repacked_tensors": repacked,
        "repack_layouts": sorted(layouts),
        "amx_repacked_tensors": amx_repacked,
        "settings": settings,
    }


# ---------------------------------------------------------------------------
# The engine


@dataclass(frozen=True)
class LlamaCppOptions:
    """What a llama.cpp arm may set. ``None`` means llama.cpp's or this module's default (recorded)."""

    n_threads: int | None = None  # None: every logical CPU (llama-cpp-python's own default is half)
    n_threads_batch: int | None = None  # None: n_threads
    n_ctx: int = 2048
    n_batch: int = 512
    n_ubatch: int = 512
    use_mmap: bool = True
    use_extra_bufts: bool | None = None  # None: choose_extra_bufts()
    flash_attn: str = "auto"  # auto | on | off
    type_k: str | None = None  # KV cache type (f16 default); e.g. q8_0
    type_v: str | None = None

    def resolved(self) -> "LlamaCppOptions":
        threads = self.n_threads or os.cpu_count() or 1
        extra, _ = choose_extra_bufts(self.use_extra_bufts)
        return LlamaCppOptions(**{**asdict(self), "n_threads": threads,
                                  "n_threads_batch": self.n_threads_batch or threads, "use_extra_bufts": extra})


def set_field(struct: ctypes.Structure, name: str, value: Any) -> None:
    """Set a field of a llama.cpp params struct, refusing names the struct does not have.

    ctypes accepts any attribute name silently; a setting renamed upstream (0.3.36
    replaced ``use_mmap`` with ``load_mode``) would otherwise be ignored without a word.
    """
    if name not in {field[0] for field in type(struct)._fields_}:
        raise LlamaCppError(f"{type(struct).__name__} has no field {name!r} in this llama-cpp-python")
    setattr(struct, name, value)


def _ggml_type(name: str) -> int:
    import llama_cpp

    value = getattr(llama_cpp, f"GGML_TYPE_{name.upper()}", None)
    if value is None:
        raise ValueError(f"unknown ggml type {name!r} (e.g. f16, q8_0, q4_0)")
    return int(value)


def llama_cpp_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


class LlamaCppEngine:
    """One model and one context (one sequence), driven token by token."""

    def __init__(self, model_path: Path | str, options: LlamaCppOptions = LlamaCppOptions(), *,
                 log: LlamaLog | None = None, echo_log: bool = True):
        import llama_cpp as L

        self.L = L
        self.path = Path(model_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        if options.flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {options.flash_attn!r}")
        self.requested = options
        self.options = options.resolved()
        self.extra_bufts_reason = choose_extra_bufts(options.use_extra_bufts)[1]
        self.log = log or LlamaLog(echo=echo_log).install()
        L.llama_backend_init()
        self.system_info = (L.llama_print_system_info() or b"").decode()

        mparams = L.llama_model_default_params()
        set_field(mparams, "load_mode", L.LLAMA_LOAD_MODE_MMAP if self.options.use_mmap else L.LLAMA_LOAD_MODE_NONE)
        set_field(mparams, "use_extra_bufts", self.options.use_extra_bufts)
        set_field(mparams, "n_gpu_layers", 0)
        self.model = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.model:
            raise LlamaCppError(f"llama.cpp could not load {self.path}: {self._last_errors()}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))

        cparams = L.llama_context_default_params()
        for name, value in (("n_ctx", self.options.n_ctx), ("n_batch", self.options.n_batch),
                            ("n_ubatch", self.options.n_ubatch), ("n_seq_max", 1),
                            ("n_threads", self.options.n_threads), ("n_threads_batch", self.options.n_threads_batch),
                            ("flash_attn_type", FLASH_ATTN[self.options.flash_attn]), ("no_perf", False)):
            set_field(cparams, name, value)
        if self.options.type_k:
            set_field(cparams, "type_k", _ggml_type(self.options.type_k))
        if self.options.type_v:
            set_field(cparams, "type_v", _ggml_type(self.options.type_v))
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise LlamaCppError(f"llama.cpp could not create a context for {self.path}: {self._last_errors()}")
        self.n_ctx = int(L.llama_n_ctx(self.ctx))
        self.n_batch = min(self.options.n_batch, self.n_ctx)
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.n_past = 0

    def _last_errors(self) -> str:
        errors = [line for level, line in self.log.lines if level >= 3 and line.strip()]
        return " | ".join(errors[-3:]) or "no error logged"

    # -- tokens ---------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        room = len(data) + 16
        buf = (self.L.llama_token * room)()
        n = self.L.llama_tokenize(self.vocab, data, len(data), buf, room, add_special, parse_special)
        if n < 0:
            raise LlamaCppError(f"tokenize: needs {-n} tokens of room")
        return list(buf[:n])

    def detokenize(self, ids: Sequence[int]) -> str:
        out = bytearray()
        buf = ctypes.create_string_buffer(256)
        for tok in ids:
            n = self.L.llama_token_to_piece(self.vocab, int(tok), buf, len(buf), 0, False)
            out += buf.raw[:max(n, 0)]
        return out.decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self.L.llama_vocab_is_eog(self.vocab, int(token)))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The model's own chat template (from the GGUF) applied to ``messages``, with the assistant turn opened."""
        L = self.L
        template = L.llama_model_chat_template(self.model, None)
        if not template:
            raise LlamaCppError(f"{self.path} has no tokenizer.chat_template")
        arr = (L.llama_chat_message * len(messages))()
        keep = []
        for i, message in enumerate(messages):
            role, content = message["role"].encode(), message["content"].encode()
            keep += [role, content]
            arr[i].role, arr[i].content = role, content
        size = 4096
        while True:
            buf = ctypes.create_string_buffer(size)
            n = L.llama_chat_apply_template(template, arr, len(messages), True, buf, size)
            if n < 0:
                raise LlamaCppError("llama_chat_apply_template failed: the GGUF's template is not one llama.cpp knows")
            if n <= size:
                return buf.raw[:n].decode("utf-8")
            size = n

    # -- evaluation -----------------------------------------------------------

    def reset(self) -> None:
        """Forget the sequence: the next prompt starts at position 0 with an empty KV cache."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def eval(self, ids: Sequence[int], *, logits: str = "last") -> None:
        """Feed ``ids`` after what is in the cache; ``logits`` 'last' or 'all' positions get logits."""
        if logits not in ("last", "all"):
            raise ValueError("logits is 'last' or 'all'")
        if self.n_past + len(ids) > self.n_ctx:
            raise LlamaCppError(f"{self.n_past} + {len(ids)} tokens exceed n_ctx {self.n_ctx}")
        if logits == "all" and len(ids) > self.n_batch:
            raise LlamaCppError(f"logits for all of {len(ids)} tokens need n_batch >= {len(ids)} (is {self.n_batch})")
        batch = self.batch
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start:start + self.n_batch]
            last_chunk = start + len(chunk) == len(ids)
            for i, tok in enumerate(chunk):
                batch.token[i] = int(tok)
                batch.pos[i] = self.n_past + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = logits == "all" or (last_chunk and i == len(chunk) - 1)
            batch.n_tokens = len(chunk)
            status = self.L.llama_decode(self.ctx, batch)
            if status != 0:
                raise LlamaCppError(f"llama_decode returned {status} at position {self.n_past}: {self._last_errors()}")
            self.n_past += len(chunk)

    def logits(self, i: int = -1) -> np.ndarray:
        """The float32 logits of output ``i`` of the last eval, as a view of llama.cpp's buffer."""
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise LlamaCppError(f"no logits for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def all_logits(self, n: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of the (n, n_vocab) logits of the last eval(..., logits='all') of n tokens, copied."""
        ptr = self.L.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab))[start:stop].copy()

    def generate_greedy(self, prompt: Sequence[int], n_tokens: int) -> list[int]:
        """Exactly ``n_tokens`` greedy tokens after ``prompt`` on a fresh sequence; EOS does not stop it."""
        self.reset()
        self.eval(prompt)
        out = []
        for step in range(n_tokens):
            token = int(np.argmax(self.logits(-1)))
            out.append(token)
            if step + 1 < n_tokens:
                self.eval([token])
        return out

    def answer(self, question: str, max_tokens: int = 32) -> str:
        """Greedy chat answer, stopping at end of generation (for smoke tests, not timing)."""
        prompt = self.tokenize(self.chat_prompt([{"role": "user", "content": question}]), add_special=True,
                               parse_special=True)
        self.reset()
        self.eval(prompt)
        out = []
        for _ in range(max_tokens):
            token = int(np.argmax(self.logits(-1)))
            if self.is_end_of_generation(token):
                break
            out.append(token)
            self.eval([token])
        return self.detokenize(out)

    # -- evidence -------------------------------------------------------------

    def evidence(self) -> dict[str, Any]:
        """What ran: the options llama.cpp got and what its log says it allocated. JSON-ready."""
        L = self.L
        desc = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.model, desc, len(desc))
        log = parse_llama_log(self.log.text())
        return {
            "engine": "llamacpp",
            "llama_cpp_python": llama_cpp_version(),
            "model_path": str(self.path),
            "model_desc": desc.value.decode(errors="replace"),
            "model_size_bytes": int(L.llama_model_size(self.model)),
            "model_params": int(L.llama_model_n_params(self.model)),
            "n_vocab": self.n_vocab,
            "n_threads": int(L.llama_n_threads(self.ctx)),
            "n_threads_batch": int(L.llama_n_threads_batch(self.ctx)),
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
            "use_mmap": self.options.use_mmap,
            "use_extra_bufts": self.options.use_extra_bufts,
            "use_extra_bufts_reason": self.extra_bufts_reason,
            "flash_attn": self.options.flash_attn,
            "cpu_has_amx": cpu_has_amx(),
            "system_info": self.system_info,
            "compiled_features": parse_system_info(self.system_info),
            **log,
        }

    def close(self) -> None:
        L = self.L
        if getattr(self, "batch", None) is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None


def vocab_tokens(gguf: Path | str, text: str) -> list[int]:
    """llama.cpp's token ids for ``text`` (no BOS, no special-token parsing), loading only the
    GGUF's vocabulary."""
    import llama_cpp as L

    LlamaLog(echo=False).install()
    params = L.llama_model_default_params()
    set_field(params, "vocab_only", True)
    model = L.llama_model_load_from_file(str(gguf).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load the vocabulary of {gguf}")
    try:
        vocab = L.llama_model_get_vocab(model)
        data = text.encode()
        buf = (L.llama_token * (len(data) + 16))()
        n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
        return list(buf[:n])
    finally:
        L.llama_model_free(model)
