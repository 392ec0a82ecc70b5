"""Small fine-tuned-style checkpoints, built locally (no model hub), for tests and the demo.

The text classifier is a real BERT-architecture model with a WordPiece tokenizer trained on a few
sentences, briefly trained on a toy sentiment set so that its labels mean something, and saved with
`save_pretrained` exactly like a fine-tune would be.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

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


def _train_tokenizer(corpus: list[str], max_length: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=600, special_tokens=specials))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_length,
    )


def write_text_classifier(out: str | Path, *, seed: int = 0, train_steps: int = 80) -> Path:
    """Write a tiny fine-tuned BERT sequence classifier (3 labels) to `out`; returns `out`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    out = Path(out)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    data = _sentences(rng, 256)
    extra = ["The package arrived on Tuesday.", "I love this product, it works perfectly.", "Terrible. It broke!"]
    tokenizer = _train_tokenizer([s for s, _ in data] + extra, max_length=128)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)},
        architectures=["BertForSequenceClassification"],
    )
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()
    for step in range(train_steps):
        batch = rng.sample(data, 32)
        enc = tokenizer([s for s, _ in batch], padding=True, return_tensors="pt")
        loss = model(**enc, labels=torch.tensor([y for _, y in batch])).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    log.info("trained the fixture classifier for %d steps (final loss %.3f)", train_steps, loss.item())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(
        "# tiny-bert-sentiment (rtxserve fixture)\n\nA 2-layer BERT sequence classifier with labels "
        f"{', '.join(LABELS)}, trained for {train_steps} steps on templated toy sentences. For tests only.\n"
    )
    return out


FIXTURES = {"text-classifier": write_text_classifier}


def write_fixtures(folder: str | Path, names: list[str] | None = None) -> dict[str, Path]:
    """Write the named fixtures (default: all) into `folder`/<name>; returns name -> path."""
    unknown = set(names or []) - set(FIXTURES)
    if unknown:
        raise ValueError(f"unknown fixture(s) {sorted(unknown)}; valid: {', '.join(FIXTURES)}")
    folder = Path(folder)
    return {name: FIXTURES[name](folder / name) for name in (names or list(FIXTURES))}
