"""The memory breakdown's weight classes: each storage once, a tied head with the embedding."""

from __future__ import annotations

import torch

from vllm_omni_edge.evidence import _weights_by_class


class Head(torch.nn.Embedding):
    pass


class Tiny(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(10, 4)  # 160 bytes
        self.q_proj = torch.nn.Linear(4, 8, bias=False)  # 128 bytes
        self.norm = torch.nn.LayerNorm(4)  # 32 bytes
        self.lm_head = Head(10, 4)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def test_each_storage_is_counted_once_by_its_owner():
    types = ((torch.nn.Embedding,), (Head,))
    assert _weights_by_class(Tiny(tied=False), *types) == {"embedding": 160, "linear": 128, "other": 32, "head": 160}
    assert _weights_by_class(Tiny(tied=True), *types) == {"embedding": 160, "linear": 128, "other": 32}
