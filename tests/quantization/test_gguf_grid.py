"""A GGUF's 4-bit weights are stored on their own grid: the file's codes, not a re-quantization."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.gguf_tiny import quantized_copy, write_tiny_gguf
from vllm_omni_edge.models import gguf_to_hf
from vllm_omni_edge.quantization.int4 import Int4FormatError, dequantize, quantize_on_grid, unpack_nibbles


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny llama (Q/K rows permuted by llama.cpp's converter) in three 4-bit types."""
    root = tmp_path_factory.mktemp("grid")
    f32 = write_tiny_gguf(root / "llama.gguf", "llama")
    return {qtype: quantized_copy(f32, qtype) for qtype in ("q4_0", "q4_1", "q4_k_m")}


def _hf(path):
    """(HF name -> float32 GGUF dequantization, HF name -> grid), in the rows our build stores."""
    reader = gguf_to_hf._open_reader(path)
    plan = gguf_to_hf._plan(reader, gguf_to_hf._metadata(reader), path)
    grids: dict = {}
    weights = dict(gguf_to_hf.iter_hf_tensors(reader, plan, grids=grids))
    return reader, weights, grids


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q4_k_m"])
def test_the_files_weights_lie_on_their_grid(tiny, qtype):
    reader, weights, grids = _hf(tiny[qtype])
    four_bit = [t for t in reader.tensors if gguf_to_hf.grid_of(t) is not None]
    assert four_bit and len(grids) == len(four_bit)
    negative = 0
    for name, (scale, offset) in grids.items():
        w = weights[name]
        assert scale.shape == offset.shape == (w.shape[0], w.shape[1] // 32) and (scale >= 0).all()
        s = np.repeat(scale, 32, axis=1)
        o = np.repeat(offset, 32, axis=1)
        q = np.divide(w - o, s, out=np.zeros_like(w), where=s > 0)
        assert np.abs(q - np.round(q)).max() < 2e-3, name
        assert q.min() > -2e-3 and q.max() < 15 + 2e-3, name
        assert np.allclose(np.round(q) * s + o, w, rtol=0, atol=1e-6 + 1e-5 * np.abs(w).max())
    if qtype == "q4_0":  # d takes the sign of the largest weight: some grids were read from the other end
        raw = [t for t in reader.tensors if gguf_to_hf.grid_of(t) is not None]
        for t in raw:
            d = np.ascontiguousarray(np.asarray(t.data, np.uint8).reshape(-1, 18)[:, :2]).view(np.float16)
            negative += int((d < 0).sum())
        assert negative > 0


def test_quantize_on_grid_keeps_the_codes():
    gen = torch.Generator().manual_seed(0)
    n, k = 48, 256
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    # Offsets within 16 steps of zero, as Q4_0 (-8 d) and Q4_K's -dmin * m give.
    offset = -torch.rand(n, k // 32, generator=gen) * 16 * scale
    scale[3, 2] = 0.0  # a constant group
    codes = torch.randint(0, 16, (n, k), generator=gen)
    w = codes.reshape(n, -1, 32) * scale.unsqueeze(-1) + offset.unsqueeze(-1)
    w = w.reshape(n, k).to(torch.bfloat16)  # what the bf16 conversion hands the builder
    qweight, scales, offsets = quantize_on_grid(w, scale, offset)
    got = unpack_nibbles(qweight).reshape(n, -1, 32)
    want = codes.reshape(n, -1, 32).clone()
    want[3, 2] = 0
    assert torch.equal(got.long(), want)
    assert scales.dtype == offsets.dtype == torch.bfloat16 and scales[3, 2] == 1
    back = dequantize(qweight, scales, offsets)
    assert torch.allclose(back, w.float(), atol=float(scale.max()) * 15 * 2**-7)
    # Far from zero (offset hundreds of steps away) bf16 moves the grid by up to a step: each
    # weight still takes the nearest point of the grid as stored.
    far = offset - 300 * scale
    wf = (codes.reshape(n, -1, 32) * scale.unsqueeze(-1) + far.unsqueeze(-1)).reshape(n, k).to(torch.bfloat16)
    qf, sf, of = quantize_on_grid(wf, scale, far)
    step = sf.float().repeat_interleave(32, dim=1)
    err = (dequantize(qf, sf, of) - wf.float()).abs()
    inside = (unpack_nibbles(qf) > 0) & (unpack_nibbles(qf) < 15)  # not clamped at an end
    assert (err[inside] <= step[inside] / 2 + 1e-6).all()
    with pytest.raises(Int4FormatError, match="does not fit"):
        quantize_on_grid(w, scale[:, :4], offset[:, :4].contiguous()[:, :3])
    with pytest.raises(Int4FormatError, match="negative"):
        quantize_on_grid(w, -scale, offset)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_k_m"])
def test_a_gguf_build_stores_its_4bit_weights_with_the_files_codes(tiny, qtype, tmp_path):
    from safetensors.torch import load_file

    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint

    _, weights, grids = _hf(tiny[qtype])
    report = build_cpu_int4_checkpoint(tiny[qtype], tmp_path / "int4", progress=False)
    stored = load_file(str(tmp_path / "int4" / "model.safetensors"))
    on_grid = 0
    for name, (scale, offset) in grids.items():
        prefix = name.removesuffix(".weight")
        if f"{prefix}.qweight" not in stored:
            continue  # kept bf16 by the builder (a tied head), not 4-bit
        s = np.repeat(scale, 32, axis=1)
        o = np.repeat(offset, 32, axis=1)
        want = np.round(np.divide(weights[name] - o, s, out=np.zeros_like(s), where=s > 0))
        got = unpack_nibbles(stored[f"{prefix}.qweight"]).numpy()
        assert np.array_equal(got, want.astype(np.uint8)), name
        on_grid += 1
    assert on_grid and sum(report.on_gguf_grid.values()) == on_grid
    assert "stored on their GGUF grid" in report.table()


def test_a_build_from_a_checkpoint_directory_has_no_grid(tiny, tmp_path):
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint

    hf = gguf_to_hf.convert_gguf_to_hf(tiny["q4_0"], tmp_path / "bf16", grids_out=tmp_path / "grids.safetensors")
    assert (tmp_path / "grids.safetensors").is_file() and not list(hf.glob("*grid*"))
    report = build_cpu_int4_checkpoint(hf, tmp_path / "int4", progress=False)
    assert not report.on_gguf_grid
    for directory in (hf, tmp_path / "int4"):  # both list the added tokens (models/tokenizer_config.py)
        assert "added_tokens_decoder" in json.loads((directory / "tokenizer_config.json").read_text())


def test_grids_given_wrongly_are_refused_by_name(tiny, tmp_path):
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint

    hf = gguf_to_hf.convert_gguf_to_hf(tiny["q4_0"], tmp_path / "bf16", grids_out=tmp_path / "grids.safetensors")
    with pytest.raises(FileNotFoundError, match="GGUF grids file not found: .*missing.safetensors"):
        build_cpu_int4_checkpoint(hf, tmp_path / "a", progress=False, grids=tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="grids are read from a .gguf source itself"):
        build_cpu_int4_checkpoint(tiny["q4_0"], tmp_path / "b", progress=False, grids=tmp_path / "grids.safetensors")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # A build with the grids of the file it was converted from stores the same weights as from the file.
    formats = {"embedding": "int4", "head": "int4"}
    from_dir = build_cpu_int4_checkpoint(hf, tmp_path / "c", progress=False, grids=tmp_path / "grids.safetensors",
                                         **formats)
    from_file = build_cpu_int4_checkpoint(tiny["q4_0"], tmp_path / "d", progress=False, **formats)
    assert dict(from_dir.on_gguf_grid) == dict(from_file.on_gguf_grid) and from_dir.on_gguf_grid
    from safetensors.torch import load_file

    c, d = (load_file(str(tmp_path / x / "model.safetensors")) for x in ("c", "d"))
    assert c.keys() == d.keys() and all(torch.equal(c[k], d[k]) for k in c)
