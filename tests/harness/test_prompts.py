from vllm_omni_edge_bench.harness.pass_vllm import discarded_settings
from vllm_omni_edge_bench.harness.prompts import FIXED_TEXT, PromptBank


class WordTokenizer:
    """One token per word: enough to test exact lengths without a real tokenizer."""

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False  # a BOS would change every count
        return [hash(word) % 50000 for word in text.split()]


def test_prompts_have_exact_lengths_and_never_repeat_a_start():
    bank = PromptBank.from_tokenizer(WordTokenizer())
    assert len(bank.token_ids) >= len(FIXED_TEXT.split()) - 1
    prompts = [bank.take(n) for n in (1, 16, 64, 512, 2048, 16, 16)]
    assert [len(p) for p in prompts] == [1, 16, 64, 512, 2048, 16, 16]
    assert len({tuple(p[:16]) for p in prompts[1:]}) == 6  # no two share a 16-token prefix


def test_offsets_cycle_only_after_every_start_was_used():
    bank = PromptBank(list(range(37 * 3)))  # a length the stride divides is made co-prime
    starts = [bank.take(1)[0] for _ in range(len(bank.token_ids))]
    assert len(set(starts)) == len(bank.token_ids)


def test_a_setting_the_front_end_replaced_is_reported():
    asked = {"kv_cache_memory_bytes": 201326592, "max_model_len": 512, "enforce_eager": True, "dtype": "auto"}
    resolved = {"kv_cache_memory_bytes": 1 << 30, "max_model_len": 512, "enforce_eager": True, "dtype": "torch.bfloat16"}
    assert discarded_settings(asked, resolved) == [
        "front end resolved kv_cache_memory_bytes=1073741824, the arm asked for 201326592"]
