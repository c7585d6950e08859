"""Convert a GGUF file into a bf16 Hugging Face checkpoint directory.

transformers dequantizes GGUF tensors on load. Its config then carries a GGUF
quantization marker that vLLM would try to honour, so we save the state dict
ourselves and write a config without ``quantization_config``.
"""

from __future__ import annotations

import json

from pathlib import Path

from vllm_omni_edge.atomic import atomic_directory
from vllm_omni_edge.log import get_logger

logger = get_logger("convert")

# Architectures whose GGUF -> HF mapping we have run end to end.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")


class UnsupportedCheckpointError(ValueError):
    """The input is not a checkpoint this tool can convert."""


def read_gguf_architecture(gguf_path: Path) -> str:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:  # gguf raises bare ValueError/struct errors
        raise UnsupportedCheckpointError(
            f"{gguf_path} is not a readable GGUF file: {exc}"
        ) from exc
    field = reader.fields.get("general.architecture")
    if field is None:
        raise UnsupportedCheckpointError(
            f"{gguf_path} has no general.architecture field"
        )
    return bytes(field.parts[field.data[0]]).decode()


def convert_gguf_to_hf(
    gguf_path: Path, out_dir: Path, *, progress=None, manifest: dict | None = None
) -> Path:
    """Write a bf16 safetensors checkpoint + config + tokenizer to ``out_dir``.

    The directory appears only when complete (atomic rename). ``progress`` is an
    optional callable taking a step description, used for the CLI progress bar.
    ``manifest``, if given, is written as ``edge-manifest.json`` inside the same
    atomic write, so a directory with a manifest is always complete.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    arch = read_gguf_architecture(gguf_path)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step = progress or (lambda _msg: None)
    src_dir, name = str(gguf_path.parent), gguf_path.name

    step("dequantizing GGUF to bf16")
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, dtype=torch.bfloat16, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(
        src_dir, gguf_file=name, local_files_only=True
    )

    with atomic_directory(Path(out_dir)) as tmp:
        step("writing safetensors")
        state = {
            k: v.contiguous()
            for k, v in model.state_dict().items()
            # Tied heads are stored once, as HF does.
            if not (model.config.tie_word_embeddings and k == "lm_head.weight")
        }
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)  # safetensors creates it 0600

        step("writing config and tokenizer")
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["torch_dtype"] = "bfloat16"
        config.pop("dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        model.generation_config.to_json_file(str(tmp / "generation_config.json"))
        tokenizer.save_pretrained(str(tmp))
        if not getattr(tokenizer, "chat_template", None):
            raise UnsupportedCheckpointError(
                f"{gguf_path} carries no chat template (tokenizer.chat_template)"
            )
        if manifest is not None:
            (tmp / "edge-manifest.json").write_text(json.dumps(manifest, indent=2))
    logger.info("converted %s (%s) to %s", gguf_path, arch, out_dir)
    return Path(out_dir)
