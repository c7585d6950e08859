"""patches/worker/checkpoint_read_per_tensor.py: the same tensors as safe_open, read, not mapped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_omni_edge.patches.worker import checkpoint_read_per_tensor as patch


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.1.w": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "model.layers.0.w": torch.randn(3, 4, generator=g),
        "half": torch.randn(6, generator=g).to(torch.float16),
        "packed": torch.randint(0, 255, (4, 16), dtype=torch.uint8, generator=g),
        "signed": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "index": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "fp8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    return path


def test_same_names_order_dtypes_shapes_and_values_as_safe_open(checkpoint):
    with safe_open(str(checkpoint), framework="pt") as f:
        expected = [(name, f.get_tensor(name)) for name in f.keys()]
    got = list(patch.read_safetensors(str(checkpoint)))
    assert [n for n, _ in got] == [n for n, _ in expected]
    assert all(_same(a, b) for (_, a), (_, b) in zip(got, expected))


def test_nothing_of_the_file_stays_mapped(checkpoint):
    with safe_open(str(checkpoint), framework="pt") as f:
        f.get_tensor("packed")
        assert _mapped(checkpoint)  # what the patch avoids: safe_open maps the file
    reader = patch.read_safetensors(str(checkpoint))
    next(reader)
    assert not _mapped(checkpoint)
    list(reader)
    assert not _mapped(checkpoint)


def test_skipped_tensors_are_not_read(checkpoint):
    names = [n for n, _ in patch.read_safetensors(str(checkpoint), skip=lambda n: n.startswith("model."))]
    assert names and not any(n.startswith("model.") for n in names)


def test_a_truncated_file_is_a_clear_error(checkpoint, tmp_path):
    data = checkpoint.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-10])
    with pytest.raises(patch.CheckpointReadError, match="truncated"):
        list(patch.read_safetensors(str(cut)))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00")
    with pytest.raises(patch.CheckpointReadError, match="not a safetensors file"):
        list(patch.read_safetensors(str(junk)))


def test_vllms_iterator_is_replaced_once_and_keeps_other_strategies(checkpoint, monkeypatch):
    from vllm.model_executor.model_loader import default_loader, weight_utils

    original = getattr(weight_utils.safetensors_weights_iterator, "__wrapped__",
                       weight_utils.safetensors_weights_iterator)
    monkeypatch.setattr(weight_utils, "safetensors_weights_iterator", original)
    monkeypatch.setattr(default_loader, "safetensors_weights_iterator", original)
    patch._wrap(default_loader)
    patch._wrap(weight_utils)
    wrapped = weight_utils.safetensors_weights_iterator
    assert wrapped is not original and wrapped.__wrapped__ is original
    assert default_loader.safetensors_weights_iterator is wrapped

    before = patch.stats["tensors"]
    ours = dict(wrapped([str(checkpoint)], False, None, safetensors_prefetch_num_threads=4))
    assert patch.stats["tensors"] - before == len(_tensors())
    theirs = dict(original([str(checkpoint)], False, None))
    assert ours.keys() == theirs.keys()
    assert all(_same(ours[n], theirs[n]) for n in ours)

    before = patch.stats["tensors"]
    eager = dict(wrapped([str(checkpoint)], False, "eager"))
    assert eager.keys() == theirs.keys() and patch.stats["tensors"] == before


def test_the_flag_selects_vllms_mapping(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_CHECKPOINT_READ", "mmap")
    assert "mmap" in patch.apply()
    monkeypatch.setenv("VLLM_OMNI_EDGE_CHECKPOINT_READ", "sometimes")
    with pytest.raises(ValueError, match="VLLM_OMNI_EDGE_CHECKPOINT_READ"):
        patch.apply()
