"""The fidelity metric, on tiny random models and random distributions (seconds, no vLLM)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_omni_edge_bench.harness import fidelity
from vllm_omni_edge_bench.harness.fidelity import (
    HFLogitSource,
    PositionLogprobs,
    ReferenceCache,
    ScoringPlan,
    VllmPromptLogprobSource,
    compare,
    kl_per_position,
    parse_prompt_logprobs,
    reference_logprobs,
    score_windows,
    windows_of_ids,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WINDOW, STRIDE, MAX_TOKENS = 24, 10, 90  # 8 windows, 89 scored positions


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Others measure on this box: one thread, and tiny models."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_tokenizer(text: str, size: int = 120):
    """A WordLevel tokenizer over the text's most frequent words; the rest are [UNK]."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = [w for w, _ in Whitespace().pre_tokenize_str(text)]
    common = sorted(Counter(words).items(), key=lambda kv: (-kv[1], kv[0]))[: size - 1]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, (w, _) in enumerate(common)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def tiny_llama(vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def text() -> str:
    return fidelity.load_text()


@pytest.fixture(scope="module")
def models(tmp_path_factory, text):
    """A tiny random Llama and a perturbed copy, saved as local checkpoints with a tokenizer."""
    root = tmp_path_factory.mktemp("fidelity-models")
    tokenizer = build_tokenizer(text)
    base = tiny_llama(len(tokenizer.get_vocab()), seed=0)
    base_dir = root / "base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in base.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    perturbed_dir = root / "perturbed"
    base.save_pretrained(perturbed_dir)
    tokenizer.save_pretrained(perturbed_dir)
    return {"base": base_dir, "perturbed": perturbed_dir, "tokenizer": tokenizer}


@pytest.fixture(scope="module")
def plan(models, text) -> ScoringPlan:
    return ScoringPlan.build(models["tokenizer"], text, WINDOW, STRIDE, max_tokens=MAX_TOKENS)


# ---------------------------------------------------------------------------
# The shipped text and the windows


def test_shipped_text_is_fixed_public_domain_prose():
    text = fidelity.load_text("alice")
    readme = (fidelity.TEXTS_DIR / "README.md").read_text()
    assert "Alice's Adventures in Wonderland" in readme and "1865" in readme and "public domain" in readme
    assert len(text.split()) > 2000  # a few thousand tokens with any subword tokenizer
    assert text.isascii()
    with pytest.raises(ValueError, match="no fixed text"):
        fidelity.load_text("no-such-text")


def test_windows_are_deterministic_and_score_each_token_once(models, text):
    tok = models["tokenizer"]
    first = score_windows(tok, text, WINDOW, STRIDE, max_tokens=MAX_TOKENS)
    again = score_windows(build_tokenizer(text), text, WINDOW, STRIDE, max_tokens=MAX_TOKENS)
    assert first == again
    ids = fidelity.encode_text(tok, text)[:MAX_TOKENS]
    scored = []
    for i, window in enumerate(first):
        assert list(window.ids) == ids[window.start:window.start + len(window.ids)]
        assert len(window.ids) <= WINDOW and window.score_from >= 1
        assert window.start == i * STRIDE
        if i:  # after the first window every target has at least window - stride tokens before it
            assert window.score_from == WINDOW - STRIDE
        scored += [window.start + j for j in range(window.score_from, len(window.ids))]
    assert scored == list(range(1, MAX_TOKENS))  # every token but the first, once, in order
    assert fidelity.windows_digest(first) == fidelity.windows_digest(again)
    assert score_windows(tok, text, WINDOW, STRIDE + 1, max_tokens=MAX_TOKENS) != first


def test_window_edges():
    assert windows_of_ids([5, 6], 2, 1) == [fidelity.Window(ids=(5, 6), score_from=1, start=0)]
    short = windows_of_ids(range(10), 4, 3)
    assert [w.start for w in short] == [0, 3, 6]
    assert sum(w.n_scored for w in short) == 9
    for bad in ((1, 1), (4, 4), (4, 0), (4, 5)):
        with pytest.raises(ValueError):
            windows_of_ids(range(10), *bad)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        windows_of_ids([1], 4, 2)


# ---------------------------------------------------------------------------
# Sources and compare() on tiny models


def direct_logprobs(model_dir: Path, plan: ScoringPlan) -> tuple[np.ndarray, np.ndarray]:
    """(N, V) float64 log-probabilities and targets, computed here without fidelity.py."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows, targets = [], []
    with torch.no_grad():
        for window in plan.windows:
            logits = model(torch.tensor([window.ids])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            for j in range(window.score_from, len(window.ids)):
                rows.append(lp[j - 1].numpy())
                targets.append(window.ids[j])
    return np.stack(rows), np.array(targets)


def test_identical_sources_give_zero_divergence(models, plan):
    a = HFLogitSource(models["base"], "float32").logprobs(plan.windows, top_k=None)
    b = HFLogitSource(models["base"], "float32").logprobs(plan.windows, top_k=None)
    assert a.tokens == plan.tokens == MAX_TOKENS - 1
    for ref, cand in ((a, b), (a.topk(8), b.topk(8)), (a.topk(8), b)):
        result = compare(ref, cand)
        assert result["kld_mean"] == pytest.approx(0.0, abs=1e-9)
        assert result["kld_p99"] == pytest.approx(0.0, abs=1e-9)
        assert result["same_top1"] == 1.0
        assert result["ppl_ratio"] == pytest.approx(1.0, abs=1e-12)
        assert result["tokens"] == plan.tokens
    assert compare(a, b)["kld_form"] == "exact"
    # A top-k candidate that also reports the reference's ids, as HFLogitSource does.
    ref = a.topk(8)
    cand = HFLogitSource(models["base"], "float32").logprobs(plan.windows, top_k=4, include_ids=ref.ids)
    result = compare(ref, cand)
    assert result["kld_mean"] == pytest.approx(0.0, abs=1e-9) and result["same_top1"] == 1.0
    assert result["resolved_mass_mean"] == pytest.approx(compare(ref, a)["resolved_mass_mean"])


def test_perturbed_model_matches_a_direct_computation(models, plan):
    lp, targets = direct_logprobs(models["base"], plan)
    lq, _ = direct_logprobs(models["perturbed"], plan)
    ref = HFLogitSource(models["base"], "float32").logprobs(plan.windows, top_k=None)
    cand = HFLogitSource(models["perturbed"], "float32").logprobs(plan.windows, top_k=None)
    assert np.array_equal(ref.target_ids, targets)

    result = compare(ref, cand)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    assert result["kld_mean"] > 1e-3
    assert result["kld_mean"] == pytest.approx(kl.mean(), rel=1e-4)
    assert result["kld_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-4)
    assert result["kld_max"] == pytest.approx(kl.max(), rel=1e-4)
    assert result["same_top1"] == pytest.approx(np.mean(lp.argmax(1) == lq.argmax(1)))
    rows = np.arange(len(targets))
    ppl_ref = math.exp(-lp[rows, targets].mean())
    ppl_cand = math.exp(-lq[rows, targets].mean())
    assert result["ppl_ref"] == pytest.approx(ppl_ref, rel=1e-5)
    assert result["ppl_cand"] == pytest.approx(ppl_cand, rel=1e-5)
    assert result["ppl_ratio"] == pytest.approx(ppl_cand / ppl_ref, rel=1e-5)
    assert result["ppl_ratio"] != pytest.approx(1.0, abs=1e-4)

    # Top-k reference; the candidate adds the reference's ids: KL over {top k} + rest, by hand.
    k = 8
    ref_k = ref.topk(k)
    cand_k = HFLogitSource(models["perturbed"], "float32").logprobs(plan.windows, top_k=3, include_ids=ref_k.ids)
    top = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    p_s, q_s = np.take_along_axis(np.exp(lp), top, 1), np.take_along_axis(np.exp(lq), top, 1)
    p_r, q_r = 1 - p_s.sum(1), 1 - q_s.sum(1)
    kl_k = (p_s * np.log(p_s / q_s)).sum(1) + p_r * np.log(p_r / q_r)
    result_k = compare(ref_k, cand_k)
    assert result_k["kld_form"] == "top-k lower bound"
    assert result_k["kld_mean"] == pytest.approx(kl_k.mean(), rel=1e-4)
    assert result_k["kld_mean"] <= result["kld_mean"]
    assert result_k["resolved_mass_mean"] == pytest.approx(p_s.sum(1).mean(), rel=1e-5)
    assert result_k["ppl_ratio"] == pytest.approx(result["ppl_ratio"], rel=1e-6)
    assert result_k["same_top1"] == result["same_top1"]


def test_bf16_reference_runs_and_differs_a_little(models, plan):
    bf16 = HFLogitSource(models["base"], "bfloat16").logprobs(plan.windows, top_k=16)
    fp32 = HFLogitSource(models["base"], "float32").logprobs(plan.windows, top_k=None)
    result = compare(bf16, fp32)
    assert 0 < result["kld_mean"] < 0.05
    assert 0.9 < result["ppl_ratio"] < 1.1


# ---------------------------------------------------------------------------
# The top-k approximation on random distributions


def random_pair(n=300, vocab=40, seed=0):
    rng = np.random.default_rng(seed)
    temperature = rng.uniform(0.3, 3.0, size=(n, 1))  # peaked to flat
    logits = rng.normal(size=(n, vocab)) / temperature
    noisy = logits + rng.normal(scale=0.5, size=(n, vocab))
    lp = logits - fidelity._logsumexp(logits, 1)[:, None]
    lq = noisy - fidelity._logsumexp(noisy, 1)[:, None]
    targets = rng.integers(0, vocab, size=n)
    return PositionLogprobs.from_dense(lp, targets), PositionLogprobs.from_dense(lq, targets), lp, lq


def test_topk_kl_is_a_lower_bound_that_tightens_with_k():
    ref, cand, lp, lq = random_pair()
    full = kl_per_position(ref, cand)["kl"]
    assert np.allclose(full, (np.exp(lp) * (lp - lq)).sum(1))
    previous = np.zeros_like(full)
    for k in (1, 2, 5, 10, 20, 39, 40):
        out = kl_per_position(ref.topk(k), cand)
        kl = out["kl"]
        assert np.all(kl <= full + 1e-12), k
        assert np.all(kl >= previous - 1e-12), k  # top-k sets are nested: a finer partition
        # The gap is the tail's own KL weighted by its reference mass.
        top = np.argsort(-lp, axis=1, kind="stable")[:, :k]
        tail = np.ones_like(lp, dtype=bool)
        np.put_along_axis(tail, top, False, axis=1)
        p, q = np.exp(lp), np.exp(lq)
        p_r = np.where(tail, p, 0).sum(1)
        q_r = np.where(tail, q, 0).sum(1)
        with np.errstate(divide="ignore", invalid="ignore"):
            tail_kl = np.where(tail, (p / p_r[:, None]) * np.log((p / p_r[:, None]) / (q / q_r[:, None])), 0).sum(1)
        gap = np.where(p_r > 0, p_r * np.nan_to_num(tail_kl), 0)
        assert np.allclose(full - kl, gap, atol=1e-10), k
        assert np.allclose(out["unresolved"], p_r)
        previous = kl
    # One token or none left in the rest bucket: the partition KL is the full KL.
    assert np.allclose(kl_per_position(ref.topk(39), cand)["kl"], full, atol=1e-12)
    assert compare(ref.topk(40), cand)["kld_form"] == "exact"


def test_bound_holds_when_the_candidate_reports_only_its_own_top_k():
    ref, cand, lp, lq = random_pair(seed=3)
    full = kl_per_position(ref, cand)["kl"]
    cand_own = cand.topk(5)  # an engine's top 5, not the reference's ids
    for k in (1, 5, 10):
        out = kl_per_position(ref.topk(k), cand_own)
        assert np.all(out["kl"] <= full + 1e-12)
        assert np.all(out["resolved"] <= kl_per_position(ref.topk(k), cand)["resolved"] + 1e-12)
    result = compare(ref.topk(10), cand_own)
    assert result["same_top1"] == compare(ref, cand)["same_top1"]
    assert result["ppl_ratio"] == pytest.approx(compare(ref, cand)["ppl_ratio"])


def test_misaligned_inputs_are_refused():
    ref, cand, _, _ = random_pair(n=10)
    with pytest.raises(ValueError, match="positions"):
        compare(ref, cand.rows(slice(0, 9)))
    shifted = PositionLogprobs.from_dense(cand.logprobs, (cand.target_ids + 1) % 40)
    with pytest.raises(ValueError, match="different tokens"):
        compare(ref, shifted)


# ---------------------------------------------------------------------------
# The cache


class CountingSource:
    def __init__(self, inner: HFLogitSource):
        self.inner, self.calls = inner, 0

    def identity(self):
        return self.inner.identity()

    def logprobs(self, windows, *, top_k, include_ids=None):
        self.calls += 1
        return self.inner.logprobs(windows, top_k=top_k, include_ids=include_ids)


def test_cache_hits_by_content_hash(tmp_path, models, text, plan):
    cache = ReferenceCache(tmp_path / "cache")
    source = CountingSource(HFLogitSource(models["base"], "float32"))
    assert isinstance(source, fidelity.LogitSource)
    ref, key, hit = reference_logprobs(source, plan, cache, top_k=8)
    assert not hit and source.calls == 1 and key in cache
    again, key2, hit2 = reference_logprobs(source, plan, cache, top_k=8)
    assert hit2 and key2 == key and source.calls == 1  # not recomputed
    for name in ("target_ids", "target", "top1", "ids", "rest"):
        assert np.array_equal(getattr(ref, name), getattr(again, name)), name
    assert np.array_equal(ref.logprobs.astype(np.float32), again.logprobs)
    assert compare(ref, again)["kld_mean"] == 0.0
    assert [p.name for p in cache.dir.iterdir()] == [f"{key}.npz"]  # no temporary files left
    meta = cache.meta(key)
    assert meta["key"] == key and meta["inputs"]["window"] == WINDOW

    identity = source.identity()
    perturbed = HFLogitSource(models["perturbed"], "float32").identity()
    assert plan.reference_key(identity, 8) == key  # stable
    other_text = ScoringPlan.build(models["tokenizer"], text.replace("Alice", "Alicia", 1), WINDOW, STRIDE,
                                   max_tokens=MAX_TOKENS)
    other_window = ScoringPlan.build(models["tokenizer"], text, WINDOW + 1, STRIDE, max_tokens=MAX_TOKENS)
    other_tokenizer = ScoringPlan.build(build_tokenizer(text, size=100), text, WINDOW, STRIDE, max_tokens=MAX_TOKENS)
    misses = {
        "text": other_text.reference_key(identity, 8),
        "window": other_window.reference_key(identity, 8),
        "tokenizer": other_tokenizer.reference_key(identity, 8),
        "model": plan.reference_key(perturbed, 8),
        "dtype": plan.reference_key({**identity, "dtype": "bfloat16"}, 8),
        "top_k": plan.reference_key(identity, 16),
    }
    assert len(set(misses.values()) | {key}) == len(misses) + 1
    for what, other in misses.items():
        assert cache.get(other) is None, what

    # The model's identity follows its weights' bytes.
    _, key3, hit3 = reference_logprobs(CountingSource(HFLogitSource(models["perturbed"], "float32")),
                                       plan, cache, top_k=8)
    assert not hit3 and key3 == misses["model"]


def test_checkpoint_identity_follows_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "README.md").write_text("notes")
    first = fidelity.checkpoint_identity(tmp_path)
    (tmp_path / "README.md").write_text("other notes")
    assert fidelity.checkpoint_identity(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"\1" + b"\0" * 63)
    assert fidelity.checkpoint_identity(tmp_path) != first
    with pytest.raises(ValueError, match="no config.json"):
        fidelity.checkpoint_identity(tmp_path / "empty")


def test_cache_refuses_dense_and_foreign_files(tmp_path):
    ref, _, _, _ = random_pair(n=5)
    cache = ReferenceCache(tmp_path)
    with pytest.raises(ValueError, match="top-k"):
        cache.put("ab" * 32, ref)
    cache.put("ab" * 32, ref.topk(3))
    (tmp_path / f"{'cd' * 32}.npz").write_bytes((tmp_path / f"{'ab' * 32}.npz").read_bytes())
    with pytest.raises(ValueError, match="delete it"):
        cache.get("cd" * 32)
    (tmp_path / f"{'ef' * 32}.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="delete it"):
        cache.get("ef" * 32)
    with pytest.raises(ValueError, match="not a reference key"):
        cache.path("../x")


# ---------------------------------------------------------------------------
# vLLM's prompt logprobs, on fakes of its output structures


@dataclass
class Logprob:  # the fields of vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def fake_position(lp_row: np.ndarray, prompt_token: int, k: int) -> dict[int, Logprob]:
    """What vLLM builds: the prompt token with its rank, then the top k with ranks 1..k."""
    order = np.argsort(-lp_row, kind="stable")
    rank_of = {int(t): r + 1 for r, t in enumerate(order)}
    entry = {prompt_token: Logprob(float(lp_row[prompt_token]), rank_of[prompt_token])}
    entry.update({int(t): Logprob(float(lp_row[t]), r + 1) for r, t in enumerate(order[:k])})
    return entry


def fake_outputs(windows, lp: np.ndarray, k: int):
    outputs, row = [], 0
    for window in windows:
        plp = [None] + [{} for _ in range(len(window.ids) - 1)]
        for j in range(1, len(window.ids)):
            # vLLM reports every prompt position; only scored ones come from lp, others are junk.
            source = lp[row + j - window.score_from] if j >= window.score_from else lp[0]
            plp[j] = fake_position(source, window.ids[j], k)
        row += window.n_scored
        outputs.append(SimpleNamespace(prompt_token_ids=list(window.ids), prompt_logprobs=plp,
                                       outputs=[SimpleNamespace(token_ids=[7])]))
    return outputs


def test_vllm_prompt_logprobs_are_parsed():
    windows = windows_of_ids(np.random.default_rng(5).integers(0, 40, size=30).tolist(), 12, 5)
    n = sum(w.n_scored for w in windows)
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(n, 40)) * 2
    lp = logits - fidelity._logsumexp(logits, 1)[:, None]
    targets = [t for w in windows for t in w.targets]
    k = 4
    parsed = parse_prompt_logprobs(fake_outputs(windows, lp, k), windows)

    assert parsed.tokens == n and list(parsed.target_ids) == targets
    assert np.allclose(parsed.target, lp[np.arange(n), targets])
    assert np.array_equal(parsed.top1, lp.argmax(1))
    ranks = np.argsort(np.argsort(-lp, axis=1, kind="stable"), axis=1)[np.arange(n), targets] + 1
    widths = (parsed.ids >= 0).sum(1)
    assert np.array_equal(widths, np.where(ranks > k, k + 1, k))  # the target joins when outside the top k
    for row in range(n):
        known = parsed.ids[row][parsed.ids[row] >= 0]
        assert set(np.argsort(-lp[row])[:k]) <= set(known)
        assert np.allclose(parsed.logprobs[row][: len(known)], lp[row, known])
        assert parsed.rest[row] == pytest.approx(math.log(1 - np.exp(lp[row, known]).sum()), rel=1e-9)

    # Scored against the full distributions it came from.
    ref = PositionLogprobs.from_dense(lp, targets)
    result = compare(ref.topk(10), parsed)
    assert result["kld_mean"] == pytest.approx(0.0, abs=1e-12)
    assert result["same_top1"] == 1.0 and result["ppl_ratio"] == pytest.approx(1.0)


def test_vllm_parser_refuses_what_it_cannot_score():
    windows = windows_of_ids([1, 2, 3, 4, 5], 5, 2)
    lp = np.log(np.full((4, 8), 1 / 8))
    good = fake_outputs(windows, lp, 2)
    bad_ids = [SimpleNamespace(**{**vars(good[0]), "prompt_token_ids": [1, 2, 3, 4, 6]})]
    with pytest.raises(ValueError, match="other prompt tokens"):
        parse_prompt_logprobs(bad_ids, windows)
    with pytest.raises(ValueError, match="prompt_logprobs=k"):
        parse_prompt_logprobs([SimpleNamespace(**{**vars(good[0]), "prompt_logprobs": None})], windows)
    missing = list(good[0].prompt_logprobs)
    missing[3] = {t: v for t, v in missing[3].items() if t != 4}  # target of position 3 is token 4
    with pytest.raises(ValueError, match="target token 4"):
        parse_prompt_logprobs([SimpleNamespace(prompt_token_ids=[1, 2, 3, 4, 5], prompt_logprobs=missing)], windows)
    with pytest.raises(ValueError, match="outputs for"):
        parse_prompt_logprobs([], windows)


def test_vllm_source_asks_for_prompt_logprobs_and_one_token():
    windows = windows_of_ids(list(range(20)), 8, 4)
    n = sum(w.n_scored for w in windows)
    lp = np.log(np.full((n, 32), 1 / 32))
    calls = []

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm=True):
            calls.append((prompts, params, use_tqdm))
            return fake_outputs(windows, lp, params["prompt_logprobs"])

    source = VllmPromptLogprobSource(FakeLLM(), identity={"arm": "x"}, params_factory=lambda **kw: kw)
    out = source.logprobs(windows, top_k=5, include_ids=np.zeros((n, 3), dtype=np.int64))
    prompts, params, use_tqdm = calls[0]
    assert prompts == [{"prompt_token_ids": list(w.ids)} for w in windows]
    assert params == {"prompt_logprobs": 5, "max_tokens": 1, "temperature": 0.0, "detokenize": False}
    assert out.tokens == n and not use_tqdm
    assert source.identity() == {"engine": "vllm", "arm": "x"}
    with pytest.raises(ValueError, match="top_k"):
        source.logprobs(windows, top_k=None)


# ---------------------------------------------------------------------------
# The command line and the harness hooks


def test_command_line_reference_then_hf_candidate(tmp_path, models, capsys):
    args = ["--model", str(models["base"]), "--dtype", "float32", "--window", str(WINDOW), "--stride",
            str(STRIDE), "--max-tokens", str(MAX_TOKENS), "--top-k", "8", "--cache", str(tmp_path)]
    assert fidelity.main(["reference", *args]) == 0
    first = json.loads(capsys.readouterr().out)
    assert not first["cache_hit"] and first["tokens"] == MAX_TOKENS - 1
    assert re.fullmatch(r"[0-9a-f]{64}", first["reference_key"])
    assert fidelity.main(["hf", *args, "--candidate", str(models["perturbed"])]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["cache_hit"] and second["reference_key"] == first["reference_key"]
    assert second["result"]["kld_mean"] > 0 and second["result"]["tokens"] == MAX_TOKENS - 1

    settings = fidelity.FidelitySettings.from_mapping(
        {"kind": "fidelity", "label": "fidelity", "reference": str(models["base"]), "reference_dtype": "float32",
         "window": WINDOW, "stride": STRIDE, "max_tokens": MAX_TOKENS, "reference_top_k": 8,
         "cache_dir": str(tmp_path)})
    assert settings.reference_key() == first["reference_key"]
    assert "--top-k 8" in settings.command()


def test_vllm_workload_scores_against_the_cached_reference(tmp_path, models):
    workload = {"kind": "fidelity", "label": "fidelity", "reference": str(models["base"]),
                "reference_dtype": "float32", "window": WINDOW, "stride": STRIDE, "max_tokens": MAX_TOKENS,
                "reference_top_k": 8, "top_k": 4, "cache_dir": str(tmp_path)}
    settings = fidelity.FidelitySettings.from_mapping(workload)
    plan = settings.plan()
    hf = HFLogitSource(models["base"], "float32")
    dense = hf.logprobs(plan.windows, top_k=None)

    class FakeLLM:
        def get_tokenizer(self):
            return models["tokenizer"]

        def generate(self, prompts, params, use_tqdm=True):
            assert [p["prompt_token_ids"] for p in prompts] == [list(w.ids) for w in plan.windows]
            return fake_outputs(plan.windows, dense.logprobs.astype(np.float64), params.prompt_logprobs)

    missing = fidelity.run_vllm_workload(FakeLLM(), workload)
    assert missing["figures"] == {} and "no cached reference" in missing["problems"][0]

    reference_logprobs(hf, plan, settings.cache(), top_k=8)
    done = fidelity.run_vllm_workload(FakeLLM(), workload, params_factory=lambda **kw: SimpleNamespace(**kw))
    assert done["problems"] == []
    figures = done["figures"]
    assert set(figures) == {"fidelity KLD mean", "fidelity KLD p99", "fidelity same top-1", "fidelity PPL ratio"}
    assert figures["fidelity KLD mean"]["value"] == pytest.approx(0.0, abs=1e-6)
    assert figures["fidelity same top-1"]["value"] == 100.0
    assert all({"value", "unit", "better", "source"} <= set(f) for f in figures.values())
