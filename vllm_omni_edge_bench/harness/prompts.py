"""Prompts of an exact token count, cut from one fixed text.

Prompts are given to the engine as token ids, so the count is exact and no chat
template or BOS rule can change it. Each request starts at a new offset in the
text, so no two requests of a pass share a prefix and a prefix cache cannot turn
a "prefill" measurement into a cache lookup (the pass also checks vLLM's
``num_cached_tokens`` to be sure).
"""

from __future__ import annotations

# Plain prose with varied words; any fixed text would do, it only has to stay fixed.
FIXED_TEXT = """\
The lighthouse keeper wrote the weather into a ledger every morning, before the kettle
boiled and before the gulls began their arguments on the roof. Wind from the south-west,
force five, falling. Visibility good. A trawler passed the northern reef at half past six
and sounded twice, which meant the skipper had seen the lamp and wished to be remembered.
The ledger was older than the keeper. Its first pages were written in a brown ink that had
faded to the colour of tea, in a hand that looped its capitals as if each one were a small
ceremony. Later hands were hurried, then careful again, then hurried; one keeper drew tiny
boats in the margins, another recorded only numbers, and a third, for a single winter,
wrote down what he had dreamt. In spring the island filled with nesting birds and the
paths became a negotiation. Puffins watched from their burrows with the solemn curiosity
of clerks. The keeper counted them for the naturalists on the mainland, who sent back
letters thanking him and asking for more precise figures, which he could not give, because
a puffin does not hold still to be counted and the wind does not hold still to be measured.
Supplies came by boat on the first Thursday of each month: flour, lamp oil, tinned fruit,
newspapers already a fortnight old, and sometimes a parcel of books from a library that
had forgotten, he suspected, that it was lending them. He read about deserts and railways,
about the chemistry of salt and the habits of bees, about a city built on wooden piles
driven into a lagoon. He read slowly, because there was time, and because the lamp needed
trimming at intervals that no book could be allowed to interrupt. When storms came they
came from the west, low and fast, and the tower hummed like a struck glass. He learned to
tell the strength of a gale from the note it made in the stairwell. At night the beam went
round and round, and every thirty seconds it touched the same black rock, the same white
crest, the same empty stretch of water where, once, long before his time, a ship had
turned the wrong way in the fog. The ledger recorded that too, in the brown ink, in a
single line with no capitals at all.
"""


class PromptBank:
    """Hands out token-id prompts of exact lengths from a cyclic stream of ids."""

    # A prime step: offsets repeat only after len(token_ids) requests.
    STRIDE = 37

    def __init__(self, token_ids: list[int]):
        if len(token_ids) < 2:
            raise ValueError("the fixed text must encode to at least 2 tokens")
        self.token_ids = list(token_ids)
        if len(self.token_ids) % self.STRIDE == 0:
            self.token_ids.pop()  # keep the step co-prime with the length
        self.requests = 0

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "PromptBank":
        return cls(tokenizer.encode(FIXED_TEXT, add_special_tokens=False))

    def take(self, n_tokens: int) -> list[int]:
        if n_tokens < 1:
            raise ValueError("a prompt needs at least one token")
        start = (self.requests * self.STRIDE) % len(self.token_ids)
        self.requests += 1
        ids = self.token_ids
        return [ids[(start + i) % len(ids)] for i in range(n_tokens)]
