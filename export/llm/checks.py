"""What an LLM source must be before anything is written: a causal-LM or vision-language checkpoint vLLM can serve
(architecture, every weight file, tokenizer, chat template, a vision model's processor), and a LoRA adapter's fit to
its base. No weights are loaded here."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from core import lora

from ..checkpoint import TOKENIZER_FILES, read_json
from ..exceptions import ExportError
from ..lora_adapter import AdapterInfo, base_folder
from .package import weight_files

log = logging.getLogger(__name__)

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")

# Vision-language models, and how an image reaches the prompt: the chat template writes a placeholder that
# the processor expands into image tokens (Qwen-VL), or the processor puts its query tokens in itself (None).
VLM_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "<|image_pad|>",
    "Qwen2_5_VLForConditionalGeneration": "<|image_pad|>",
    "Qwen3VLForConditionalGeneration": "<|image_pad|>",
    "Blip2ForConditionalGeneration": None,
}


@dataclass(frozen=True)
class LLMCheckpoint:
    path: Path
    config: dict
    architecture: str
    weights: tuple[Path, ...]
    dtype: str
    chat_template: bool
    vision: bool = False

    @property
    def max_model_len(self) -> int | None:
        text = self.config.get("text_config") or {}
        return self.config.get("max_position_embeddings") or text.get("max_position_embeddings")


def chat_template_text(path: Path) -> str:
    """The folder's chat template (chat_template.jinja, chat_template.json or tokenizer_config.json), or ''."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    for name, what in (("chat_template.json", "chat template"), ("tokenizer_config.json", "tokenizer")):
        if (path / name).is_file():
            template = read_json(path / name, what).get("chat_template")
            if template:
                return template if isinstance(template, str) else json.dumps(template)
    return ""


def has_chat_template(path: Path) -> bool:
    return bool(chat_template_text(path))


def _check_vision(path: Path, architecture: str, chat_template: Path | None) -> None:
    """A vision-language model needs its image processor, and a chat template that places its images."""
    if not any((path / name).is_file() for name in PROCESSOR_FILES):
        raise ExportError(f"{architecture} in {path} has no processor config ({' or '.join(PROCESSOR_FILES)}): save the "
                          "processor beside the model (processor.save_pretrained)")
    placeholder = VLM_ARCHITECTURES[architecture]
    template = Path(chat_template).read_text() if chat_template else chat_template_text(path)
    if placeholder and placeholder not in template:
        raise ExportError(f"the chat template of {path} never writes {placeholder}, the placeholder {architecture}'s "
                          "processor turns into image tokens: images would not reach the model. Use the model's own "
                          "chat template (--chat-template FILE)")


def inspect_llm(path: str | Path, chat_template: Path | None = None) -> LLMCheckpoint:
    """Check that `path` is a causal-LM or vision-language checkpoint vLLM can serve (no weights are loaded);
    `chat_template` is the template that will replace the folder's own."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ExportError(f"model folder not found: {path}" if not path.exists() else f"{path} is not a directory")
    if not (path / "config.json").is_file():
        raise ExportError(f"{path} is not a Hugging Face model folder: no config.json "
                          "(pass the folder written by save_pretrained(), or an adapter folder with adapter_config.json)")
    config = read_json(path / "config.json", "checkpoint")
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    causal = [a for a in architectures if a.endswith("ForCausalLM") or a in VLM_ARCHITECTURES]
    if not causal:
        raise ExportError(f"{path / 'config.json'} names architectures {', '.join(architectures) or '(none)'}; "
                          "an LLM export needs a *ForCausalLM model or a vision-language model "
                          f"({', '.join(VLM_ARCHITECTURES)})")
    vision = causal[0] in VLM_ARCHITECTURES
    if vision:
        _check_vision(path, causal[0], chat_template)
    quant = config.get("quantization_config")
    if quant and (quant.get("load_in_4bit") or quant.get("bnb_4bit_quant_type")):
        raise ExportError(f"{path} is a bitsandbytes 4-bit model; pass the full-precision base model instead")
    weights = weight_files(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ExportError(f"no tokenizer in {path}: save the tokenizer beside the model (tokenizer.save_pretrained)")
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return LLMCheckpoint(path, config, causal[0], weights, dtype, has_chat_template(path), vision)


def check_lora_against_base(adapter: AdapterInfo, base: LLMCheckpoint, *, for_vllm: bool) -> None:
    """Every LoRA tensor must fit a layer of the base: a wrong base fails here with both names."""
    try:
        lora.check_fit(adapter.path, adapter.config, adapter.shapes, base.path, lora.tensor_shapes(base.weights),
                       base.config, for_vllm=for_vllm)
    except lora.AdapterFitError as exc:
        way_out = {"misfit": " (--base)", "vllm": f" in {adapter.path}; merge the adapter into its base with --merge instead"}
        raise ExportError(f"{exc}{way_out.get(exc.kind, '')}") from None


def resolve_base(adapter: AdapterInfo, base: str | Path | None) -> LLMCheckpoint:
    return inspect_llm(base_folder(adapter, base))


def warn_no_chat_template(where: Path) -> None:
    log.warning("WARNING: %s has no chat template: /v1/completions works, /v1/chat/completions will be refused by vLLM; "
                "add one with --chat-template FILE", where)
