"""Fidelity: how far an arm's next-token distributions are from a reference's.

Every arm is scored on the same token windows cut from one fixed text
(``texts/``), against a reference (by default the checkpoint run by
transformers in bf16). The figures (exact definitions in :func:`compare`):

- ``kld_mean``, ``kld_p99``: KL(reference || arm) per scored position, in nats;
- ``same_top1``: how often the arm's most likely token is the reference's;
- ``ppl_ref``, ``ppl_cand``, ``ppl_ratio``: perplexities on the text, and their ratio.

The pieces are engine-neutral:

- :func:`score_windows` turns (tokenizer, text, window, stride) into token-id
  windows. Every engine is fed these ids, never the text, so an engine's own
  tokenizer cannot change what is scored.
- A :class:`LogitSource` turns windows into :class:`PositionLogprobs`: per scored
  position, either the whole vocabulary's log-probabilities (dense form) or the
  top k with the log of the rest's mass (top-k form), plus the exact
  log-probability of the token that came next. :class:`HFLogitSource`
  (transformers) and :class:`VllmPromptLogprobSource` (vLLM's prompt logprobs)
  are the two here; another engine (llama.cpp) needs only to produce the same
  thing, e.g. through :func:`positions_from_dicts`.
- :func:`compare` turns a reference and a candidate into the figures. In the
  top-k form, KL is computed on a coarser distribution: the reference's top-k
  tokens whose candidate log-probability is known, plus one "rest" bucket. That
  is a lower bound of the full KL (see :func:`kl_per_position`).
- :class:`ReferenceCache` keeps references (top-k form) on disk, keyed by a hash
  of the reference's checkpoint and dtype, the tokenizer, the text, the window
  settings and k (:meth:`ScoringPlan.reference_key`), so a reference is computed
  once.

    python -m vllm_omni_edge_bench.harness.fidelity reference [--model default] [--dtype bfloat16]
    python -m vllm_omni_edge_bench.harness.fidelity hf --candidate PATH [--candidate-dtype float32]

See docs/edge/harness.md, section "Fidelity".
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from vllm_omni_edge.atomic import atomic_write_bytes

TEXTS_DIR = Path(__file__).resolve().parent / "texts"
DEFAULT_TEXT = "alice"
DEFAULT_WINDOW = 512
DEFAULT_STRIDE = 256
REFERENCE_TOP_K = 64  # tokens kept per position in a cached reference
CANDIDATE_TOP_K = 20  # prompt logprobs asked of an engine; vLLM's default max_logprobs
FORMAT_VERSION = 1  # of the cache files and of the key; bump to invalidate every reference
# An engine's top-k log-probabilities are float32; 1 - sum(exp(top k)) can come out
# at or below zero when the top k hold nearly all the mass. The rest's mass is
# floored here; the error this can cause in a KL is at most about P(rest) * 23 nats.
REST_FLOOR = 1e-10
DTYPES = ("bfloat16", "float16", "float32")
_CHUNK_ELEMENTS = 1 << 22  # rows of the comparison are processed in chunks of about this many cells


# ---------------------------------------------------------------------------
# Texts and windows


def load_text(name: str = DEFAULT_TEXT) -> str:
    """A shipped text by name (``texts/<name>.txt``), exactly as stored."""
    path = TEXTS_DIR / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in TEXTS_DIR.glob("*.txt"))
        raise ValueError(f"no fixed text {name!r} (known: {', '.join(known)})")
    return path.read_text(encoding="utf-8")


@dataclass(frozen=True)
class Window:
    """A run of token ids fed to the engine as one prompt.

    ``ids[score_from:]`` are the scored targets: target ``ids[j]`` is predicted from
    the logits at position ``j - 1``. ``start`` is where ``ids[0]`` is in the text.
    """

    ids: tuple[int, ...]
    score_from: int
    start: int

    @property
    def targets(self) -> tuple[int, ...]:
        return self.ids[self.score_from:]

    @property
    def n_scored(self) -> int:
        return len(self.ids) - self.score_from


def encode_text(tokenizer, text: str) -> list[int]:
    """The text's token ids, without special tokens (no BOS): the same for every engine."""
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def windows_of_ids(ids: Sequence[int], window: int, stride: int, *, max_tokens: int | None = None) -> list[Window]:
    """Sliding windows of ``window`` tokens, starting every ``stride`` tokens.

    Every token but the first is scored exactly once, in the first window that
    contains it after the tokens already scored. So after the first window each
    target has at least ``window - stride`` tokens of context, and the first
    window's targets have what precedes them. The last window may be shorter.
    """
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride < window:
        raise ValueError(f"stride must be in [1, window); got stride {stride}, window {window}")
    ids = [int(i) for i in ids]
    if max_tokens is not None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the text must encode to at least 2 tokens")
    windows: list[Window] = []
    start, scored_to = 0, 1  # token 0 has no context, so it is never a target
    while True:
        end = min(start + window, len(ids))
        windows.append(Window(ids=tuple(ids[start:end]), score_from=scored_to - start, start=start))
        scored_to = end
        if end == len(ids):
            return windows
        start += stride


def score_windows(tokenizer, text: str, window: int = DEFAULT_WINDOW, stride: int = DEFAULT_STRIDE,
                  *, max_tokens: int | None = None) -> list[Window]:
    """The token windows every source is scored on; deterministic for a tokenizer and text."""
    return windows_of_ids(encode_text(tokenizer, text), window, stride, max_tokens=max_tokens)


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def windows_digest(windows: Sequence[Window]) -> str:
    return _sha256(json.dumps([[w.start, w.score_from, list(w.ids)] for w in windows], separators=(",", ":")))


def tokenizer_identity(tokenizer) -> str:
    """SHA-256 of the tokenizer's vocabulary (token -> id, added tokens included).

    Engine-neutral: it says what the ids mean. How the text is split into ids is
    covered separately, by hashing the windows themselves.
    """
    vocab = tokenizer.get_vocab()
    items = sorted(((str(tok), int(i)) for tok, i in vocab.items()), key=lambda kv: (kv[1], kv[0]))
    return _sha256(json.dumps(items, ensure_ascii=False, separators=(",", ":")))


# Files whose bytes determine a checkpoint's logits (the tokenizer is hashed on its own).
_CHECKPOINT_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
                        "*.pt", "*.pth", "*.gguf")
_checkpoint_memo: dict[tuple, str] = {}


def checkpoint_identity(path: Path | str) -> str:
    """SHA-256 over (name, size, SHA-256 of content) of the files that define a checkpoint's logits.

    Those are ``config.json`` and the weight files (``*.safetensors``, ``*.bin``,
    ...) of the directory, followed through symlinks. Other files (README,
    generation config, tokenizer) do not take part. Remembered per process, by
    path, size and mtime, so a pass does not hash the weights twice.
    """
    path = Path(path).expanduser().resolve()
    files = [path] if path.is_file() else sorted(
        {p for pattern in _CHECKPOINT_PATTERNS for p in path.glob(pattern) if p.is_file()})
    if not files:
        raise ValueError(f"{path}: no config.json or weight files to identify the checkpoint by")
    entries = []
    for file in files:
        stat = file.stat()
        memo_key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
        digest = _checkpoint_memo.get(memo_key)
        if digest is None:
            sha = hashlib.sha256()
            with open(file, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    sha.update(block)
            digest = _checkpoint_memo[memo_key] = sha.hexdigest()
        entries.append([file.name, stat.st_size, digest])
    return _sha256(json.dumps(entries, separators=(",", ":")))


@dataclass(frozen=True)
class ScoringPlan:
    """What is scored: a text cut into windows by one tokenizer, and how it was cut."""

    text_sha256: str
    window: int
    stride: int
    max_tokens: int | None
    tokenizer_id: str
    windows: tuple[Window, ...]

    @classmethod
    def build(cls, tokenizer, text: str, window: int = DEFAULT_WINDOW, stride: int = DEFAULT_STRIDE,
              *, max_tokens: int | None = None) -> "ScoringPlan":
        return cls(
            text_sha256=_sha256(text),
            window=window,
            stride=stride,
            max_tokens=max_tokens,
            tokenizer_id=tokenizer_identity(tokenizer),
            windows=tuple(score_windows(tokenizer, text, window, stride, max_tokens=max_tokens)),
        )

    @property
    def tokens(self) -> int:
        """Scored positions."""
        return sum(w.n_scored for w in self.windows)

    def key_payload(self, reference: Mapping[str, Any], top_k: int | None) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "reference": dict(reference),
            "tokenizer": self.tokenizer_id,
            "text_sha256": self.text_sha256,
            "window": self.window,
            "stride": self.stride,
            "max_tokens": self.max_tokens,
            "top_k": top_k,
            "windows_sha256": windows_digest(self.windows),
        }

    def reference_key(self, reference: Mapping[str, Any], top_k: int | None) -> str:
        """Content hash naming a cached reference.

        ``reference`` is the source's :meth:`LogitSource.identity` (for
        :class:`HFLogitSource`: engine, checkpoint hash, dtype). Changing any of
        it, the tokenizer's vocabulary, the text, the window settings, the token
        windows or ``top_k`` gives another key.
        """
        return _sha256(json.dumps(self.key_payload(reference, top_k), sort_keys=True, separators=(",", ":")))


# ---------------------------------------------------------------------------
# Log-probabilities at scored positions


def _logsumexp(a: np.ndarray, axis: int = -1) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(a - m), axis=axis, keepdims=True)) + m
    return np.squeeze(out, axis=axis)


@dataclass
class PositionLogprobs:
    """Next-token log-probabilities at every scored position of a list of windows.

    Row ``t`` is one scored position. Rows run window by window in the order of
    the windows, and within a window in token order, so row ``t`` predicts
    ``target_ids[t]``. Natural logarithms throughout.

    - ``target`` (N,): log p(target_ids[t]), always exact, even when the target
      is not among ``ids``. Perplexity comes from it.
    - ``top1`` (N,): the id of the most likely token (the source's own argmax).
    - Dense form: ``ids is None``; ``logprobs`` is (N, V) and column v is token v.
    - Top-k form: ``ids`` (N, K) and ``logprobs`` (N, K) are the tokens whose
      log-probability is known (padding: id -1, log-probability -inf; one id at
      most once per row), and ``rest`` (N,) is log of the mass of every other
      token (-inf if none). Rows may hold the source's top k and other ids, e.g.
      the target, or ids a reference asked for.
    """

    target_ids: np.ndarray
    target: np.ndarray
    top1: np.ndarray
    logprobs: np.ndarray
    ids: np.ndarray | None = None
    rest: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.target_ids = np.asarray(self.target_ids, dtype=np.int64).reshape(-1)
        n = self.target_ids.shape[0]
        self.target = np.asarray(self.target, dtype=np.float64).reshape(-1)
        self.top1 = np.asarray(self.top1, dtype=np.int64).reshape(-1)
        self.logprobs = np.asarray(self.logprobs)
        if self.logprobs.dtype not in (np.float32, np.float64):
            self.logprobs = self.logprobs.astype(np.float32)
        if self.target.shape[0] != n or self.top1.shape[0] != n:
            raise ValueError("target_ids, target and top1 must have one entry per position")
        if self.logprobs.ndim != 2 or self.logprobs.shape[0] != n:
            raise ValueError(f"logprobs must be (positions, K or V) = ({n}, ...), got {self.logprobs.shape}")
        if self.ids is None:
            if self.rest is not None:
                raise ValueError("the dense form has no rest: every token is in logprobs")
        else:
            self.ids = np.asarray(self.ids, dtype=np.int64)
            if self.ids.shape != self.logprobs.shape:
                raise ValueError(f"ids {self.ids.shape} and logprobs {self.logprobs.shape} differ in shape")
            if self.rest is None:
                raise ValueError("the top-k form needs rest: log of the mass outside ids")
            self.rest = np.asarray(self.rest, dtype=np.float64).reshape(-1)
            if self.rest.shape[0] != n:
                raise ValueError("rest must have one entry per position")

    @property
    def dense(self) -> bool:
        return self.ids is None

    @property
    def tokens(self) -> int:
        return int(self.target_ids.shape[0])

    @classmethod
    def from_dense(cls, logprobs: np.ndarray, target_ids: Sequence[int]) -> "PositionLogprobs":
        """Dense form from (N, V) log-probabilities; target and top-1 are read from them."""
        logprobs = np.asarray(logprobs)
        target_ids = np.asarray(target_ids, dtype=np.int64)
        target = np.take_along_axis(logprobs, target_ids[:, None], axis=1)[:, 0]
        return cls(target_ids=target_ids, target=target, top1=np.argmax(logprobs, axis=1), logprobs=logprobs)

    def rows(self, index: slice) -> "PositionLogprobs":
        return PositionLogprobs(
            target_ids=self.target_ids[index], target=self.target[index], top1=self.top1[index],
            logprobs=self.logprobs[index], ids=None if self.ids is None else self.ids[index],
            rest=None if self.rest is None else self.rest[index],
        )

    def topk(self, k: int) -> "PositionLogprobs":
        """The top-k form: the k most likely known tokens per row, the others folded into ``rest``."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        lp = self.logprobs
        ids = np.broadcast_to(np.arange(lp.shape[1]), lp.shape) if self.dense else self.ids
        k = min(k, lp.shape[1])
        keyed = np.where(ids >= 0, lp, -np.inf)
        # Sort each row by log-probability, descending; ties by position (stable).
        order = np.argsort(-keyed, axis=1, kind="stable")
        keep, drop = order[:, :k], order[:, k:]
        dropped = np.take_along_axis(keyed, drop, axis=1)
        rest = _logsumexp(dropped, axis=1) if drop.shape[1] else np.full(lp.shape[0], -np.inf)
        if not self.dense:
            rest = np.logaddexp(self.rest, rest)
        kept_ids = np.take_along_axis(ids, keep, axis=1)
        kept_lp = np.take_along_axis(keyed, keep, axis=1)
        return PositionLogprobs(target_ids=self.target_ids, target=self.target, top1=self.top1,
                                logprobs=kept_lp.astype(lp.dtype), ids=kept_ids, rest=rest)

    @classmethod
    def concat(cls, parts: Sequence["PositionLogprobs"]) -> "PositionLogprobs":
        """Rows of several parts in order; top-k parts are padded to the widest."""
        if not parts:
            raise ValueError("nothing to concatenate")
        if len({p.dense for p in parts}) != 1:
            raise ValueError("cannot mix the dense and top-k forms")
        common = dict(target_ids=np.concatenate([p.target_ids for p in parts]),
                      target=np.concatenate([p.target for p in parts]),
                      top1=np.concatenate([p.top1 for p in parts]))
        if parts[0].dense:
            return cls(logprobs=np.concatenate([p.logprobs for p in parts]), **common)
        width = max(p.logprobs.shape[1] for p in parts)

        def pad(a: np.ndarray, value) -> np.ndarray:
            return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value)

        return cls(logprobs=np.concatenate([pad(p.logprobs, -np.inf) for p in parts]),
                   ids=np.concatenate([pad(p.ids, -1) for p in parts]),
                   rest=np.concatenate([p.rest for p in parts]), **common)


def positions_from_dicts(windows: Sequence[Window], per_window: Sequence[Sequence[Mapping[int, float]]],
                         top1: Sequence[Sequence[int]] | None = None) -> PositionLogprobs:
    """Top-k form from per-position ``{token_id: logprob}`` maps, the shape engines report.

    ``per_window[w][i]`` is the distribution predicting ``windows[w].targets[i]``
    and must contain that target. ``top1`` gives each position's most likely
    token if the engine says so (e.g. vLLM's rank 1); else it is the map's argmax
    (ties to the smaller id). The rest's mass is ``1 - sum(exp(logprob))``,
    floored at ``REST_FLOOR``. Any engine (llama.cpp included) can report through this.
    """
    if len(per_window) != len(windows):
        raise ValueError(f"{len(per_window)} windows of logprobs for {len(windows)} windows")
    target_ids, target, tops, rows = [], [], [], []
    for w, (window, positions) in enumerate(zip(windows, per_window)):
        if len(positions) != window.n_scored:
            raise ValueError(f"window {w}: {len(positions)} positions of logprobs, {window.n_scored} scored")
        for i, (tok, dist) in enumerate(zip(window.targets, positions)):
            dist = {int(k): float(v) for k, v in dist.items()}
            if tok not in dist:
                raise ValueError(f"window {w} position {window.score_from + i}: the target token {tok} has no "
                                 "logprob; the engine must report the prompt token's own logprob")
            target_ids.append(tok)
            target.append(dist[tok])
            tops.append(int(top1[w][i]) if top1 is not None else min(dist, key=lambda t: (-dist[t], t)))
            rows.append(dist)
    width = max(len(d) for d in rows)
    ids = np.full((len(rows), width), -1, dtype=np.int64)
    lps = np.full((len(rows), width), -np.inf, dtype=np.float64)
    for r, dist in enumerate(rows):
        ordered = sorted(dist.items(), key=lambda kv: (-kv[1], kv[0]))
        ids[r, :len(ordered)] = [t for t, _ in ordered]
        lps[r, :len(ordered)] = [v for _, v in ordered]
    with np.errstate(divide="ignore"):
        mass = np.where(ids >= 0, np.exp(lps), 0.0).sum(axis=1)
        rest = np.log(np.maximum(1.0 - mass, REST_FLOOR))
    return PositionLogprobs(target_ids=target_ids, target=target, top1=tops, logprobs=lps, ids=ids, rest=rest)


# ---------------------------------------------------------------------------
# The comparison


def _kl_rows_dense(ref: PositionLogprobs, cand: PositionLogprobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lp = ref.logprobs.astype(np.float64)
    lq = cand.logprobs.astype(np.float64)
    if lp.shape != lq.shape:
        raise ValueError(f"vocabularies differ: reference {lp.shape[1]}, candidate {lq.shape[1]} tokens")
    lp = lp - _logsumexp(lp, axis=1)[:, None]
    lq = lq - _logsumexp(lq, axis=1)[:, None]
    p = np.exp(lp)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (lp - lq), 0.0)
    n = lp.shape[0]
    return terms.sum(axis=1), np.ones(n), np.zeros(n)


def _kl_rows_partition(ref: PositionLogprobs, cand: PositionLogprobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = ref.tokens
    if ref.dense:
        r_ids = np.broadcast_to(np.arange(ref.logprobs.shape[1]), ref.logprobs.shape)
        r_rest = np.full(n, -np.inf)
    else:
        r_ids, r_rest = ref.ids, ref.rest
    r_lp = ref.logprobs.astype(np.float64)
    r_valid = r_ids >= 0
    r_lp = np.where(r_valid, r_lp, -np.inf)

    if cand.dense:
        lq_all = cand.logprobs.astype(np.float64)
        vocab = lq_all.shape[1]
        if np.any(r_ids >= vocab):
            raise ValueError(f"reference token ids go beyond the candidate's vocabulary ({vocab})")
        known = r_valid
        lq_at = np.where(known, np.take_along_axis(lq_all, np.where(r_valid, r_ids, 0), axis=1), -np.inf)
        in_s = np.zeros(lq_all.shape, dtype=bool)
        rows = np.broadcast_to(np.arange(n)[:, None], r_ids.shape)
        in_s[rows[known], r_ids[known]] = True
        q_rest = np.where(in_s, 0.0, np.exp(lq_all)).sum(axis=1)
    else:
        c_ids, c_lp = cand.ids, cand.logprobs.astype(np.float64)
        c_valid = c_ids >= 0
        match = (r_ids[:, :, None] == c_ids[:, None, :]) & r_valid[:, :, None] & c_valid[:, None, :]
        known = match.any(axis=2)
        lq_at = np.where(match, c_lp[:, None, :], -np.inf).max(axis=2)
        lq_at = np.where(known, lq_at, -np.inf)
        c_in_s = match.any(axis=1)
        q_rest = np.exp(cand.rest) + np.where(c_valid & ~c_in_s, np.exp(c_lp), 0.0).sum(axis=1)

    in_cell = known  # tokens with a cell of their own: known to both sides
    p_cells = np.where(in_cell, np.exp(r_lp), 0.0)
    q_cells = np.where(in_cell, np.exp(lq_at), 0.0)
    p_rest = np.exp(r_rest) + np.where(r_valid & ~in_cell, np.exp(r_lp), 0.0).sum(axis=1)
    zp = p_cells.sum(axis=1) + p_rest
    zq = q_cells.sum(axis=1) + q_rest
    log_zp, log_zq = np.log(zp), np.log(zq)
    with np.errstate(divide="ignore", invalid="ignore"):
        cell_terms = np.where(in_cell & (p_cells > 0),
                              (p_cells / zp[:, None]) * ((r_lp - log_zp[:, None]) - (lq_at - log_zq[:, None])), 0.0)
        pr, qr = p_rest / zp, q_rest / zq
        rest_term = np.where(pr > 0, pr * (np.log(pr) - np.log(qr)), 0.0)
    kl = cell_terms.sum(axis=1) + rest_term
    return kl, p_cells.sum(axis=1) / zp, pr


def kl_per_position(reference: PositionLogprobs, candidate: PositionLogprobs) -> dict[str, np.ndarray | bool]:
    """KL(reference || candidate) at each position, in nats.

    Both dense: the exact ``sum_v p(v) (log p(v) - log q(v))`` over the vocabulary
    (each side renormalised in float64 first, so rounding cannot push a row below 0).

    Otherwise the KL of a coarser pair of distributions. Per position, let S be
    the tokens whose log-probability both sides know (the reference's top k,
    intersected with what the candidate reported), and R everything else:
    ``KL_S = sum_{v in S} p(v) log(p(v)/q(v)) + P(R) log(P(R)/Q(R))``, with
    ``P(R) = 1 - P(S)`` taken from the sources' ``rest`` plus any known tokens
    outside S. Merging outcomes cannot increase a KL (log-sum inequality), so
    ``KL_S <= KL``; the gap is exactly ``P(R) * KL(p(.|R) || q(.|R))``, the tail's
    own divergence weighted by its reference mass. It is exact when P(R) = 0.

    Returns ``kl`` (N,), clipped at 0 (only rounding goes below); ``resolved``
    (N,): P(S), the reference mass compared token by token; ``unresolved`` (N,):
    P(R); and ``exact``.
    """
    _check_aligned(reference, candidate)
    exact = reference.dense and candidate.dense
    fn = _kl_rows_dense if exact else _kl_rows_partition
    # Cells per row of the largest temporary: (K_ref, K_cand) matches, or a dense row.
    ref_w, cand_w = reference.logprobs.shape[1], candidate.logprobs.shape[1]
    width = max(ref_w, cand_w, 1) if candidate.dense else max(ref_w * cand_w, 1)
    step = max(1, _CHUNK_ELEMENTS // width)
    parts = [fn(reference.rows(slice(i, i + step)), candidate.rows(slice(i, i + step)))
             for i in range(0, reference.tokens, step)]
    kl, resolved, unresolved = (np.concatenate([p[j] for p in parts]) for j in range(3))
    return {"kl": np.maximum(kl, 0.0), "resolved": resolved, "unresolved": unresolved,
            "exact": bool(exact or not np.any(unresolved > 0))}


def _check_aligned(reference: PositionLogprobs, candidate: PositionLogprobs) -> None:
    if reference.tokens != candidate.tokens:
        raise ValueError(f"reference has {reference.tokens} positions, candidate {candidate.tokens}")
    if reference.tokens == 0:
        raise ValueError("no positions to compare")
    if not np.array_equal(reference.target_ids, candidate.target_ids):
        first = int(np.argmax(reference.target_ids != candidate.target_ids))
        raise ValueError(f"the two were scored on different tokens (first difference at position {first})")


def compare(reference: PositionLogprobs, candidate: PositionLogprobs) -> dict[str, Any]:
    """Fidelity of ``candidate`` to ``reference`` over the same N scored positions.

    With p the reference's and q the candidate's next-token distribution at
    position t, and x_t the token that came next:

    - ``kld_mean``: mean over t of KL(p_t || q_t), in nats (:func:`kl_per_position`;
      a lower bound when either side is in top-k form, see ``kld_form``).
    - ``kld_p99``: the 99th percentile of those N values (numpy's default,
      linear interpolation between order statistics).
    - ``kld_median``, ``kld_max``: likewise.
    - ``same_top1``: the fraction of t where both sides' most likely token is the
      same (each side's own argmax, as it reported it).
    - ``ppl_ref``: ``exp(-mean_t log p_t(x_t))``; ``ppl_cand`` likewise with q.
      Exact in either form: sources always report the target's own log-probability.
    - ``ppl_ratio``: ``ppl_cand / ppl_ref`` (1 = same perplexity; above 1, worse).
    - ``tokens``: N.
    - ``kld_form``: ``"exact"``, or ``"top-k lower bound"`` when some reference mass
      was compared only as a bucket; ``resolved_mass_mean``/``_min``: the
      reference mass compared token by token (1 when exact).
    """
    kl = kl_per_position(reference, candidate)
    values = kl["kl"]
    ppl_ref = math.exp(-float(np.mean(reference.target)))
    ppl_cand = math.exp(-float(np.mean(candidate.target)))
    return {
        "kld_mean": float(np.mean(values)),
        "kld_p99": float(np.percentile(values, 99)),
        "kld_median": float(np.median(values)),
        "kld_max": float(np.max(values)),
        "same_top1": float(np.mean(reference.top1 == candidate.top1)),
        "ppl_ref": ppl_ref,
        "ppl_cand": ppl_cand,
        "ppl_ratio": ppl_cand / ppl_ref,
        "tokens": reference.tokens,
        "kld_form": "exact" if kl["exact"] else "top-k lower bound",
        "resolved_mass_mean": float(np.mean(kl["resolved"])),
        "resolved_mass_min": float(np.min(kl["resolved"])),
    }


# ---------------------------------------------------------------------------
# Sources


@runtime_checkable
class LogitSource(Protocol):
    """Anything that can score token windows: an engine, a checkpoint, a file of logits."""

    def identity(self) -> dict[str, Any]:
        """What produces the numbers (engine, checkpoint hash, dtype...); part of a reference's cache key."""
        ...

    def logprobs(self, windows: Sequence[Window], *, top_k: int | None,
                 include_ids: np.ndarray | None = None) -> PositionLogprobs:
        """Log-probabilities at every scored position of ``windows``, rows in window order.

        ``top_k=None`` asks for the dense form, an int for the top-k form. The
        target's log-probability is always exact. ``include_ids`` (N, K'), -1
        padded, are ids, typically a reference's top k, whose log-probabilities
        a source should add to each row if it can; sources that cannot (an engine
        that reports only its own top k) ignore it, and :func:`compare` then
        folds the missing ones into the rest bucket.
        """
        ...


class HFLogitSource:
    """A local transformers checkpoint (``AutoModelForCausalLM``, local files only), one window at a time.

    Logits come out in the model's dtype (bf16 for a bf16 reference) and are cast
    to float32 before ``log_softmax``. The rest's mass is the logsumexp of every
    token outside the row, from the full float32 distribution.
    """

    def __init__(self, path: Path | str, dtype: str = "bfloat16"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.path = Path(path).expanduser()
        self.dtype = dtype
        self._model = None
        self._tokenizer = None

    def identity(self) -> dict[str, Any]:
        return {"engine": "transformers", "checkpoint": checkpoint_identity(self.path), "dtype": self.dtype}

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        return self._tokenizer

    def model(self):
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(
                str(self.path), local_files_only=True, dtype=getattr(torch, self.dtype))
            self._model.eval()
        return self._model

    def logprobs(self, windows: Sequence[Window], *, top_k: int | None = REFERENCE_TOP_K,
                 include_ids: np.ndarray | None = None) -> PositionLogprobs:
        import torch

        model = self.model()
        parts, row = [], 0
        for window in windows:
            n = window.n_scored
            x = torch.tensor([window.ids], dtype=torch.long)
            with torch.inference_mode():
                # Logits of the last n + 1 positions; the last one predicts past the window.
                logits = model(input_ids=x, use_cache=False, logits_to_keep=n + 1).logits[0, :n]
                lp = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(window.targets, dtype=torch.long)
            target = lp.gather(1, targets[:, None])[:, 0]
            top1 = lp.argmax(dim=-1)
            common = dict(target_ids=targets.numpy(), target=target.numpy(), top1=top1.numpy())
            if top_k is None:
                parts.append(PositionLogprobs(logprobs=lp.numpy().copy(), **common))
            else:
                extra = None if include_ids is None else include_ids[row:row + n]
                ids, vals, rest = _topk_rows(lp, top_k, extra)
                parts.append(PositionLogprobs(logprobs=vals, ids=ids, rest=rest, **common))
            row += n
        if include_ids is not None and row != include_ids.shape[0]:
            raise ValueError(f"include_ids has {include_ids.shape[0]} rows for {row} scored positions")
        return PositionLogprobs.concat(parts)


def _topk_rows(lp, k: int, extra: np.ndarray | None):
    """Top k of each row of a (n, V) torch tensor, plus ``extra`` ids, and log of the rest's mass."""
    import torch

    k = min(k, lp.shape[1])
    vals, idx = lp.topk(k, dim=-1)
    covered = torch.zeros_like(lp, dtype=torch.bool)
    covered.scatter_(1, idx, True)
    ids, values = idx, vals
    if extra is not None and extra.size:
        inc = torch.from_numpy(np.asarray(extra, dtype=np.int64))
        inc = torch.where((inc >= 0) & ~(inc[:, :, None] == idx[:, None, :]).any(-1), inc, -1)
        # Ids repeated within a row of extra are kept once.
        sorted_inc, _ = inc.sort(dim=1)
        dup = torch.zeros_like(sorted_inc, dtype=torch.bool)
        dup[:, 1:] = (sorted_inc[:, 1:] == sorted_inc[:, :-1]) & (sorted_inc[:, 1:] >= 0)
        inc = torch.where(dup, -1, sorted_inc)
        valid = inc >= 0
        safe = torch.where(valid, inc, idx[:, :1])
        covered.scatter_(1, safe, True)
        ids = torch.cat([idx, inc], dim=1)
        values = torch.cat([vals, torch.where(valid, lp.gather(1, safe), float("-inf"))], dim=1)
    rest = lp.masked_fill(covered, float("-inf")).logsumexp(dim=-1)
    return ids.numpy(), values.numpy().copy(), rest.double().numpy()


class VllmPromptLogprobSource:
    """A ``vllm.LLM``'s prompt logprobs: ``SamplingParams(prompt_logprobs=k, max_tokens=1)``.

    vLLM returns, per prompt, ``RequestOutput.prompt_logprobs``: a list whose
    first entry is None and whose entry j maps token id -> ``Logprob(logprob,
    rank, decoded_token)`` for the distribution predicting prompt token j: the top
    k (ranks 1..k) and the prompt token itself, with its true rank, if it is not
    among them. Prompt logprobs are raw (no temperature or processors). The LLM
    must allow k: ``LLM(..., max_logprobs=k)`` when k > 20. vLLM does not read the
    prefix cache for such requests. ``include_ids`` cannot be honoured and is ignored.
    """

    def __init__(self, llm, *, identity: Mapping[str, Any] | None = None,
                 params_factory: Callable[..., Any] | None = None):
        self.llm = llm
        self._identity = dict(identity or {})
        self._params_factory = params_factory

    def identity(self) -> dict[str, Any]:
        found: dict[str, Any] = {"engine": "vllm"}
        config = getattr(getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None), "model_config", None)
        for name in ("model", "dtype", "quantization"):
            if config is not None and hasattr(config, name):
                found[name] = str(getattr(config, name))
        return {**found, **self._identity}

    def sampling_params(self, top_k: int):
        factory = self._params_factory
        if factory is None:
            from vllm import SamplingParams as factory
        # max_tokens=1: vLLM must generate something; greedy so that it is cheap and fixed.
        return factory(prompt_logprobs=top_k, max_tokens=1, temperature=0.0, detokenize=False)

    def logprobs(self, windows: Sequence[Window], *, top_k: int | None = CANDIDATE_TOP_K,
                 include_ids: np.ndarray | None = None) -> PositionLogprobs:
        if top_k is None or top_k < 1:
            raise ValueError("vLLM prompt logprobs come as a top k: give top_k >= 1")
        prompts = [{"prompt_token_ids": list(w.ids)} for w in windows]
        outputs = self.llm.generate(prompts, self.sampling_params(top_k), use_tqdm=False)
        return parse_prompt_logprobs(outputs, windows)


def parse_prompt_logprobs(outputs: Sequence[Any], windows: Sequence[Window]) -> PositionLogprobs:
    """Top-k form from vLLM ``RequestOutput``s, one per window, in window order."""
    if len(outputs) != len(windows):
        raise ValueError(f"{len(outputs)} outputs for {len(windows)} windows")
    per_window, tops = [], []
    for w, (output, window) in enumerate(zip(outputs, windows)):
        prompt = [int(t) for t in output.prompt_token_ids]
        if prompt != list(window.ids):
            raise ValueError(f"window {w}: vLLM scored other prompt tokens than the window's")
        plp = output.prompt_logprobs
        if plp is None:
            raise ValueError(f"window {w}: no prompt_logprobs; the request needs SamplingParams(prompt_logprobs=k)")
        if len(plp) != len(prompt):
            raise ValueError(f"window {w}: {len(plp)} prompt logprob entries for {len(prompt)} prompt tokens")
        if plp[0]:
            raise ValueError(f"window {w}: the first prompt position has logprobs; expected None")
        dists, window_tops = [], []
        for j in range(window.score_from, len(prompt)):
            entry = plp[j]
            if not entry:
                raise ValueError(f"window {w} position {j}: no logprobs")
            dist = {int(tok): float(lp.logprob) for tok, lp in entry.items()}
            ranked = [int(tok) for tok, lp in entry.items() if getattr(lp, "rank", None) == 1]
            window_tops.append(min(ranked) if ranked else min(dist, key=lambda t: (-dist[t], t)))
            dists.append(dist)
        per_window.append(dists)
        tops.append(window_tops)
    return positions_from_dicts(windows, per_window, tops)


def topk_rows_numpy(lp: np.ndarray, k: int, extra: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_topk_rows` without torch: top k of each row of (n, V) log-probabilities, plus ``extra``
    ids (-1 padded; repeats and ids already in the top k dropped), and log of the rest's mass."""
    n, vocab = lp.shape
    k = min(k, vocab)
    top = np.argpartition(-lp, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(lp, top, axis=1), axis=1, kind="stable")
    top = np.take_along_axis(top, order, axis=1)
    covered = np.zeros(lp.shape, dtype=bool)
    np.put_along_axis(covered, top, True, axis=1)
    ids = top
    if extra is not None and extra.size:
        extra = np.asarray(extra, dtype=np.int64)
        if extra.shape[0] != n:
            raise ValueError(f"extra ids have {extra.shape[0]} rows for {n} positions")
        extra = np.where((extra >= 0) & (extra < vocab), extra, -1)
        keep = np.full(extra.shape, -1, dtype=np.int64)
        for r in range(n):  # at most K' ids per row; rows are few (one window)
            row = [t for t in dict.fromkeys(extra[r].tolist()) if t >= 0 and not covered[r, t]]
            keep[r, :len(row)] = row
            covered[r, row] = True
        ids = np.concatenate([top, keep], axis=1)
    values = np.where(ids >= 0, np.take_along_axis(lp, np.maximum(ids, 0), axis=1), -np.inf)
    rest = _logsumexp(np.where(covered, -np.inf, lp), axis=1)
    return ids, values.astype(np.float32), rest


def log_softmax_numpy(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    return logits - _logsumexp(logits, axis=1)[:, None]


class LlamaCppLogitSource:
    """llama.cpp (``vllm_omni_edge_bench.baselines.llamacpp.LlamaCppEngine``): every position's logits of each window.

    Each window is evaluated on an empty KV cache in chunks of the engine's
    n_batch with logits for every token; log-softmax in float64 over the whole
    vocabulary, a block of rows at a time, then the top k, the target and
    ``include_ids`` (if given, e.g. the reference's top k) are kept per row. Fed
    the windows' token ids: llama.cpp's own tokenizer takes no part.
    """

    ROWS_PER_BLOCK = 64  # rows log-softmaxed at once: bounds the float64 temporaries to 64 x vocab

    def __init__(self, engine, *, identity: Mapping[str, Any] | None = None):
        self.engine = engine
        self._identity = dict(identity or {})

    def identity(self) -> dict[str, Any]:
        return {"engine": "llamacpp", "model": str(self.engine.path), **self._identity}

    def window_rows(self, ids: Sequence[int], first: int, last: int):
        """Logits (float32) of positions first..last-1 of ``ids`` on an empty cache, in blocks of rows."""
        engine = self.engine
        engine.reset()
        for start in range(0, len(ids), engine.n_batch):
            chunk = ids[start:start + engine.n_batch]
            engine.eval(chunk, logits="all")
            lo, hi = max(first, start), min(last, start + len(chunk))
            for block in range(lo, hi, self.ROWS_PER_BLOCK):
                stop = min(block + self.ROWS_PER_BLOCK, hi)
                yield engine.all_logits(len(chunk), block - start, stop - start)

    def logprobs(self, windows: Sequence[Window], *, top_k: int | None = CANDIDATE_TOP_K,
                 include_ids: np.ndarray | None = None) -> PositionLogprobs:
        parts, row = [], 0
        for window in windows:
            all_targets = np.asarray(window.targets, dtype=np.int64)
            done = 0
            # Position j - 1 predicts target ids[j]; targets start at score_from >= 1.
            for logits in self.window_rows(window.ids, window.score_from - 1, len(window.ids) - 1):
                n = logits.shape[0]
                lp = log_softmax_numpy(logits)
                targets = all_targets[done:done + n]
                common = dict(target_ids=targets, target=lp[np.arange(n), targets], top1=lp.argmax(axis=1))
                if top_k is None:
                    parts.append(PositionLogprobs(logprobs=lp.astype(np.float32), **common))
                else:
                    # The target is always reported, as vLLM's prompt logprobs do.
                    extra = targets[:, None] if include_ids is None else np.concatenate(
                        [targets[:, None], include_ids[row:row + n]], axis=1)
                    ids, vals, rest = topk_rows_numpy(lp, top_k, extra)
                    parts.append(PositionLogprobs(logprobs=vals, ids=ids, rest=rest, **common))
                done += n
                row += n
            if done != window.n_scored:
                raise ValueError(f"window at {window.start}: {done} positions scored of {window.n_scored}")
        if include_ids is not None and row != include_ids.shape[0]:
            raise ValueError(f"include_ids has {include_ids.shape[0]} rows for {row} scored positions")
        return PositionLogprobs.concat(parts)


# ---------------------------------------------------------------------------
# Cache of references


class ReferenceCache:
    """Reference log-probabilities in top-k form, one compressed ``.npz`` per key.

    A file is written whole or not at all (``atomic_write_bytes``) and names its
    key and the key's inputs inside, so a copied or renamed file is refused.
    """

    def __init__(self, directory: Path | str):
        self.dir = Path(directory).expanduser()

    def path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"not a reference key: {key!r}")
        return self.dir / f"{key}.npz"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def get(self, key: str) -> PositionLogprobs | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                arrays = {name: data[name] for name in ("target_ids", "target", "top1", "ids", "logprobs", "rest")}
        except Exception as error:  # noqa: BLE001 - any unreadable file gets the same advice
            raise ValueError(f"{path}: unreadable cached reference ({error}); delete it to recompute") from None
        if meta.get("key") != key or meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path}: holds key {meta.get('key')!r} format {meta.get('format')!r}, not {key!r}; "
                             "delete it to recompute")
        return PositionLogprobs(**arrays)

    def meta(self, key: str) -> dict[str, Any] | None:
        path = self.path(key)
        if not path.is_file():
            return None
        with np.load(path, allow_pickle=False) as data:
            return json.loads(str(data["meta"]))

    def put(self, key: str, reference: PositionLogprobs, meta: Mapping[str, Any] | None = None) -> Path:
        if reference.dense:
            raise ValueError("the cache stores the top-k form; call .topk(k) first")
        buffer = io.BytesIO()
        np.savez_compressed(
            buffer,
            target_ids=reference.target_ids.astype(np.int64),
            target=reference.target.astype(np.float64),
            top1=reference.top1.astype(np.int64),
            ids=reference.ids.astype(np.int32),
            logprobs=reference.logprobs.astype(np.float32),
            rest=reference.rest.astype(np.float64),
            meta=np.array(json.dumps({**(meta or {}), "key": key, "format": FORMAT_VERSION}, sort_keys=True)),
        )
        path = self.path(key)
        atomic_write_bytes(path, buffer.getvalue())
        return path


def reference_logprobs(source: LogitSource, plan: ScoringPlan, cache: ReferenceCache,
                       top_k: int = REFERENCE_TOP_K) -> tuple[PositionLogprobs, str, bool]:
    """The reference for ``plan``: from the cache if there, else computed by ``source`` and stored.

    Returns (reference, key, cache hit).
    """
    identity = source.identity()
    key = plan.reference_key(identity, top_k)
    cached = cache.get(key)
    if cached is not None:
        return cached, key, True
    reference = source.logprobs(plan.windows, top_k=top_k)
    if reference.dense:
        reference = reference.topk(top_k)
    cache.put(key, reference, meta={"inputs": plan.key_payload(identity, top_k), "tokens": reference.tokens})
    return reference, key, False


def score(candidate: LogitSource, plan: ScoringPlan, reference: PositionLogprobs,
          top_k: int | None = CANDIDATE_TOP_K) -> dict[str, Any]:
    """:func:`compare` of ``candidate`` on ``plan`` against ``reference``."""
    logprobs = candidate.logprobs(plan.windows, top_k=top_k, include_ids=reference.ids)
    return compare(reference, logprobs)


# ---------------------------------------------------------------------------
# Settings shared by the command line and a harness workload


def default_cache_dir() -> Path:
    from vllm_omni_edge.models.default_model import cache_root

    return cache_root() / "fidelity"


@dataclass(frozen=True)
class FidelitySettings:
    """One fidelity measurement: which reference, which text, how it is cut, how many logprobs."""

    reference: str = "default"  # checkpoint path, or 'default' for the embedded model
    reference_dtype: str = "bfloat16"
    text: str = DEFAULT_TEXT
    window: int = DEFAULT_WINDOW
    stride: int = DEFAULT_STRIDE
    max_tokens: int | None = None
    reference_top_k: int = REFERENCE_TOP_K
    top_k: int = CANDIDATE_TOP_K
    cache_dir: str | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "FidelitySettings":
        """From a grid workload's fields; other keys (kind, label) are ignored."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def reference_path(self) -> Path:
        from vllm_omni_edge_bench.harness.grid import resolve_model

        return Path(resolve_model(self.reference))

    @functools.cached_property
    def _reference_source(self) -> HFLogitSource:
        return HFLogitSource(self.reference_path(), self.reference_dtype)

    def reference_source(self) -> HFLogitSource:
        """One source per settings object, so the model and tokenizer load once."""
        return self._reference_source

    def cache(self) -> ReferenceCache:
        return ReferenceCache(self.cache_dir or default_cache_dir())

    def plan(self) -> ScoringPlan:
        """Windows cut with the reference's tokenizer: every engine gets these ids."""
        return ScoringPlan.build(self.reference_source().tokenizer(), load_text(self.text), self.window,
                                 self.stride, max_tokens=self.max_tokens)

    def reference_key(self, plan: ScoringPlan | None = None) -> str:
        plan = plan or self.plan()
        return plan.reference_key(self.reference_source().identity(), self.reference_top_k)

    def command(self) -> str:
        """The command that computes this reference."""
        parts = ["python -m vllm_omni_edge_bench.harness.fidelity reference", f"--model {self.reference}",
                 f"--dtype {self.reference_dtype}", f"--text {self.text}", f"--window {self.window}",
                 f"--stride {self.stride}", f"--top-k {self.reference_top_k}"]
        if self.max_tokens is not None:
            parts.append(f"--max-tokens {self.max_tokens}")
        if self.cache_dir:
            parts.append(f"--cache {self.cache_dir}")
        return " ".join(parts)


def fidelity_figures(result: Mapping[str, Any], label: str = "fidelity") -> dict[str, dict[str, Any]]:
    """Harness figures (value, unit, better, source) from a :func:`compare` result."""
    form = result["kld_form"]
    where = f"{result['tokens']} positions"
    return {
        f"{label} KLD mean": {"value": result["kld_mean"], "unit": "nats", "better": "lower",
                              "source": f"KL(reference || arm), mean over {where} ({form})"},
        f"{label} KLD p99": {"value": result["kld_p99"], "unit": "nats", "better": "lower",
                             "source": f"KL(reference || arm), 99th percentile over {where} ({form})"},
        f"{label} same top-1": {"value": 100.0 * result["same_top1"], "unit": "%", "better": "higher",
                                "source": f"argmax(arm) == argmax(reference), share of {where}"},
        f"{label} PPL ratio": {"value": result["ppl_ratio"], "unit": "x", "better": "lower",
                               "source": f"perplexity(arm) / perplexity(reference) over {where}"},
    }


def run_vllm_workload(llm, workload: Mapping[str, Any], *, params_factory: Callable[..., Any] | None = None
                      ) -> dict[str, Any]:
    """The ``fidelity`` workload inside a vLLM pass: score the arm against the cached reference.

    The reference must already be cached (``FidelitySettings.command()``); it is
    never computed inside a pass, where it would be timed and counted in the
    memory ledger. Returns ``{"figures", "result", "reference_key", "problems"}``.
    """
    settings = FidelitySettings.from_mapping(workload)
    plan = settings.plan()
    key = settings.reference_key(plan)
    cache = settings.cache()
    reference = cache.get(key)
    if reference is None:
        return {"figures": {}, "result": None, "reference_key": key,
                "problems": [f"fidelity: no cached reference {key} in {cache.dir}; run `{settings.command()}`"]}
    problems = []
    if tokenizer_identity(llm.get_tokenizer()) != plan.tokenizer_id:
        problems.append("fidelity: the arm's tokenizer vocabulary differs from the reference's")
    source = VllmPromptLogprobSource(llm, params_factory=params_factory)
    result = score(source, plan, reference, top_k=settings.top_k)
    label = workload.get("label", "fidelity")
    return {"figures": fidelity_figures(result, label), "result": result, "reference_key": key,
            "problems": problems}


def prepared_inputs(workload: Mapping[str, Any]) -> dict[str, Any]:
    """What a pass without transformers needs to score ``workload``: windows, reference key and file.

    Computed in the harness process (which has the reference tokenizer loaded
    already), so an engine pass (llama.cpp) never imports torch or transformers,
    whose memory would otherwise count against that engine.
    """
    settings = FidelitySettings.from_mapping(workload)
    plan = settings.plan()
    key = settings.reference_key(plan)
    return {"reference_key": key, "cache_file": str(settings.cache().path(key)), "tokenizer_id": plan.tokenizer_id,
            "windows": [[w.start, w.score_from, list(w.ids)] for w in plan.windows],
            "command": settings.command()}


def windows_from_prepared(prepared: Mapping[str, Any]) -> list[Window]:
    return [Window(ids=tuple(int(i) for i in ids), score_from=int(score_from), start=int(start))
            for start, score_from, ids in prepared["windows"]]


def run_prepared_workload(source: LogitSource, workload: Mapping[str, Any], prepared: Mapping[str, Any],
                          *, include_reference_ids: bool = False) -> dict[str, Any]:
    """The ``fidelity`` workload for any engine's :class:`LogitSource`, from :func:`prepared_inputs`.

    Same return as :func:`run_vllm_workload`. The reference must be cached already.
    By default the candidate reports what a vLLM arm reports (its own top k and
    the target), so two engines' KL lower bounds are equally tight and comparable;
    ``include_reference_ids`` resolves the KL on the reference's top k as well.
    """
    key = prepared["reference_key"]
    path = Path(prepared["cache_file"])
    reference = ReferenceCache(path.parent).get(key)
    if reference is None:
        return {"figures": {}, "result": None, "reference_key": key,
                "problems": [f"fidelity: no cached reference {key} in {path.parent}; run `{prepared['command']}`"]}
    windows = windows_from_prepared(prepared)
    settings = FidelitySettings.from_mapping(workload)
    candidate = source.logprobs(windows, top_k=settings.top_k,
                                include_ids=reference.ids if include_reference_ids else None)
    result = compare(reference, candidate)
    label = workload.get("label", "fidelity")
    return {"figures": fidelity_figures(result, label), "result": result, "reference_key": key, "problems": []}


# ---------------------------------------------------------------------------
# Command line


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="reference checkpoint, or 'default' (the embedded model)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="reference dtype")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="fixed text (vllm_omni_edge_bench/harness/texts/NAME.txt)")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--stride", type=int, default=DEFAULT_STRIDE)
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    parser.add_argument("--top-k", type=int, default=REFERENCE_TOP_K, help="tokens kept per position in the reference")
    parser.add_argument("--cache", default=None, help="reference cache directory (default: user cache/fidelity)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ref = sub.add_parser("reference", help="compute the reference once and cache it; print its key")
    _add_common(ref)
    hf = sub.add_parser("hf", help="score a transformers checkpoint against the (cached) reference")
    _add_common(hf)
    hf.add_argument("--candidate", required=True, help="candidate checkpoint, or 'default'")
    hf.add_argument("--candidate-dtype", default="float32", choices=DTYPES)
    args = parser.parse_args(argv)

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    settings = FidelitySettings(reference=args.model, reference_dtype=args.dtype, text=args.text,
                                window=args.window, stride=args.stride, max_tokens=args.max_tokens,
                                reference_top_k=args.top_k, cache_dir=args.cache)
    plan = settings.plan()
    cache = settings.cache()
    reference, key, hit = reference_logprobs(settings.reference_source(), plan, cache, settings.reference_top_k)
    out: dict[str, Any] = {"reference_key": key, "cache_hit": hit, "cache_file": str(cache.path(key)),
                           "tokens": reference.tokens, "windows": len(plan.windows)}
    if args.command == "hf":
        candidate_path = FidelitySettings(reference=args.candidate).reference_path()
        candidate = HFLogitSource(candidate_path, args.candidate_dtype)
        # A transformers candidate can report the reference's top k exactly.
        out["result"] = score(candidate, plan, reference, top_k=settings.top_k)
        out["candidate"] = {"path": str(candidate_path), "dtype": args.candidate_dtype}
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
