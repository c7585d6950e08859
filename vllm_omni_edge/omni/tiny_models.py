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


# ---- Stable Diffusion 3 (image generation through vLLM-Omni's diffusion stage) --------------
#
# SD3 is the cheapest image pipeline vLLM-Omni 0.30.0 serves natively whose every part takes
# its sizes from the checkpoint: its SD3 transformer reads ``transformer/config.json``, and the
# two CLIP encoders, the T5 encoder and the VAE are loaded with ``from_pretrained``. (Z-Image,
# for instance, hard-codes its 6B transformer's sizes.) The layout is diffusers' own
# ``StableDiffusion3Pipeline.save_pretrained``, so ``model_index.json`` names the pipeline class
# vLLM-Omni dispatches on.

TINY_SD3_VERSION = 1
SD3_VAE_SCALE = 8  # three VAE downsamplings (four blocks), as in the released VAE
SD3_PATCH = 2
SD3_SIZE_MULTIPLE = SD3_VAE_SCALE * SD3_PATCH  # width and height must be multiples of this
CLIP_HIDDEN = 32
T5_HIDDEN = 2 * CLIP_HIDDEN  # the two CLIP embeddings are concatenated and padded to T5's width
CLIP_MAX_LENGTH = 77  # the pipeline pads CLIP prompts to the tokenizer's model_max_length


def _tiny_clip_tokenizer():
    """CLIP's BPE over single characters (no merges): every printable ASCII char, word-final or not."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for code in range(33, 127):
        vocab[chr(code)] = len(vocab)
        vocab[chr(code) + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def _tiny_t5_tokenizer():
    """T5's Unigram tokenizer over single characters; pad/eos/unk at T5's ids 0/1/2."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(chr(code), -3.0) for code in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def build_tiny_sd3(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a diffusers ``StableDiffusion3Pipeline`` with random weights into ``out_dir``."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        torch.manual_seed(seed)
        clip_tokenizer = _tiny_clip_tokenizer()
        clip_config = CLIPTextConfig(
            vocab_size=len(clip_tokenizer), hidden_size=CLIP_HIDDEN, intermediate_size=64, projection_dim=CLIP_HIDDEN,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH,
            bos_token_id=clip_tokenizer.bos_token_id, eos_token_id=clip_tokenizer.eos_token_id,
            pad_token_id=clip_tokenizer.pad_token_id, hidden_act="gelu",
        )
        t5_tokenizer = _tiny_t5_tokenizer()
        t5_config = T5Config(
            vocab_size=len(t5_tokenizer), d_model=T5_HIDDEN, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )
        latent_channels = 4
        pipe = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(
                sample_size=32, patch_size=SD3_PATCH, in_channels=latent_channels, out_channels=latent_channels,
                num_layers=2, attention_head_dim=32, num_attention_heads=2, caption_projection_dim=64,
                joint_attention_dim=T5_HIDDEN, pooled_projection_dim=2 * CLIP_HIDDEN, pos_embed_max_size=96,
            ),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=AutoencoderKL(
                in_channels=3, out_channels=3, latent_channels=latent_channels,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(16,) * 4, layers_per_block=1, norm_num_groups=4, sample_size=64,
                use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
            ),
            text_encoder=CLIPTextModelWithProjection(clip_config),
            tokenizer=clip_tokenizer,
            text_encoder_2=CLIPTextModelWithProjection(clip_config),
            tokenizer_2=_tiny_clip_tokenizer(),
            text_encoder_3=T5EncoderModel(t5_config),
            tokenizer_3=t5_tokenizer,
        ).to(torch.float32)
        pipe.save_pretrained(tmp, safe_serialization=True)
        (tmp / "vllm_omni_edge_tiny.json").write_text(json.dumps({"tiny_sd3_version": TINY_SD3_VERSION}))
    return out


def tiny_sd3(cache_dir: str | Path) -> Path:
    """The cached tiny SD3 pipeline under ``cache_dir``, built on first use."""
    out = Path(cache_dir) / f"tiny-sd3-v{TINY_SD3_VERSION}"
    marker = out / "vllm_omni_edge_tiny.json"
    if (out / "model_index.json").exists() and marker.exists():
        if json.loads(marker.read_text()).get("tiny_sd3_version") == TINY_SD3_VERSION:
            return out
    return build_tiny_sd3(out)
