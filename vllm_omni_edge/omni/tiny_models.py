"""Tiny, randomly initialised checkpoints of real multi-stage architectures, built offline.

No hub: the architecture comes from transformers' own config and model classes (the
same ones vLLM-Omni loads checkpoints for); only the sizes are shrunk (few layers, small
hidden). The weights are random, so outputs are noise, but every stage, every tensor
shape and the whole pipeline are the real ones.

``build_tiny_qwen2_5_omni(dir)`` writes a Qwen2.5-Omni checkpoint (thinker with audio and
vision towers, talker, token2wav DiT + BigVGAN) that vLLM-Omni's ``qwen2_5_omni`` pipeline
serves as thinker -> talker -> code2wav. Token ids that vLLM-Omni hard-codes (speaker
tokens 151870/151872, codec BOS/EOS 8293/8294, the 152064 -> 8448 talker remap) keep
their real values, so the vocabulary sizes stay real (152064 and 8448); only the
embedding width is small.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni_edge.atomic import atomic_directory

# Bump when the layout changes: cached builds of another version are rebuilt.
TINY_QWEN2_5_OMNI_VERSION = 2
QWEN2_5_OMNI_SPECIAL_TOKENS = (  # ids 151643.. in this order, as in the released tokenizer
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>",
    "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>",
)
FIRST_SPECIAL_ID = 151643
THINKER_VOCAB = 152064
TALKER_VOCAB = 8448
SAMPLE_RATE = 24000

# Qwen's ChatML; the default system prompt is the one Qwen2.5-Omni needs for speech output.
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_HEAD_DIM = 64  # a head size vLLM's CPU attention has kernels for
TEXT_HIDDEN = 128
MROPE_SECTION = [8, 12, 12]  # sums to TEXT_HEAD_DIM / 2


def _tiny_qwen2_5_omni_config():
    from transformers import Qwen2_5OmniConfig

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": MROPE_SECTION}
    text = dict(
        vocab_size=THINKER_VOCAB, hidden_size=TEXT_HIDDEN, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096, rope_parameters=rope,
        tie_word_embeddings=False,
    )
    thinker = dict(
        # Ids the released config.json carries beyond the config class's fields; vLLM-Omni
        # reads vision_start/end for M-RoPE positions.
        vision_start_token_id=151652, vision_end_token_id=151653, vision_token_id=151654,
        bos_token_id=151644, eos_token_id=151645, pad_token_id=151643,
        text_config=text,
        audio_config=dict(
            num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
            output_dim=TEXT_HIDDEN, n_window=100, max_source_positions=1500,
        ),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT_HIDDEN,
            fullatt_block_indexes=[0], window_size=112, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2,
        ),
    )
    talker = dict(
        vocab_size=TALKER_VOCAB, embedding_size=TEXT_HIDDEN, hidden_size=TEXT_HIDDEN, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=TEXT_HEAD_DIM,
        max_position_embeddings=4096, rope_parameters=dict(rope),
    )
    token2wav = dict(
        dit_config=dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32, ff_mult=2, emb_dim=32,
            look_ahead_layers=[1], look_backward_layers=[0], block_size=24, repeats=2, num_embeds=8193,
            mel_dim=80, enc_emb_dim=32, enc_dim=32, enc_channels=[32, 32, 32, 32, 96],
            enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=16,
            enc_se_channels=16, dropout=0.0,
        ),
        bigvgan_config=dict(
            mel_dim=80, upsample_initial_channel=128, resblock_kernel_sizes=[3],
            resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
            upsample_kernel_sizes=[11, 7, 4, 4, 4, 4],
        ),
    )
    config = Qwen2_5OmniConfig(
        thinker_config=thinker, talker_config=talker, token2wav_config=token2wav, enable_audio_output=True
    )
    config.architectures = ["Qwen2_5OmniModel"]
    return config


def _tiny_tokenizer():
    """Byte-level BPE: 256 byte tokens, filler words up to the real special-token ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    # Random weights emit any id; fillers make every one of them decode to visible text.
    vocab.update({f"\u0120w{i}": i for i in range(len(vocab), FIRST_SPECIAL_ID)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_5_OMNI_SPECIAL_TOKENS])
    assert tok.token_to_id("<|endoftext|>") == FIRST_SPECIAL_ID
    return Qwen2TokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        extra_special_tokens={  # the names Qwen2_5OmniProcessor reads
            "image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
            "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
            "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
        },
    )


def build_tiny_qwen2_5_omni(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the checkpoint, tokenizer, processor and ``spk_dict.pt`` into ``out_dir``."""
    import torch
    from transformers import (
        Qwen2_5OmniForConditionalGeneration,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        torch.manual_seed(seed)
        config = _tiny_qwen2_5_omni_config()
        config.vllm_omni_edge_tiny_version = TINY_QWEN2_5_OMNI_VERSION
        model = Qwen2_5OmniForConditionalGeneration(config).to(torch.float32).eval()
        model.save_pretrained(tmp, safe_serialization=True)

        # Small pixel bounds keep vLLM's multimodal profiling inputs tiny.
        pixels = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
        processor = Qwen2_5OmniProcessor(
            image_processor=Qwen2VLImageProcessor(**pixels),
            video_processor=Qwen2VLVideoProcessor(**pixels),
            feature_extractor=WhisperFeatureExtractor(feature_size=128),
            tokenizer=_tiny_tokenizer(),
            chat_template=CHAT_TEMPLATE,
        )
        processor.save_pretrained(tmp)

        dit = config.token2wav_config.dit_config
        speakers = {
            name: {
                "cond": torch.randn(1, dit.enc_emb_dim),
                "ref_mel": torch.randn(1, 300, dit.mel_dim),
                "bos_token": bos,
            }
            for name, bos in (("Chelsie", 151872), ("Ethan", 151870))
        }
        torch.save(speakers, tmp / "spk_dict.pt")
    return out


def tiny_qwen2_5_omni(cache_dir: str | Path) -> Path:
    """The cached tiny checkpoint under ``cache_dir``, built on first use."""
    out = Path(cache_dir) / f"tiny-qwen2_5-omni-v{TINY_QWEN2_5_OMNI_VERSION}"
    config = out / "config.json"
    if config.exists() and (out / "spk_dict.pt").exists():
        if json.loads(config.read_text()).get("vllm_omni_edge_tiny_version") == TINY_QWEN2_5_OMNI_VERSION:
            return out
    return build_tiny_qwen2_5_omni(out)
