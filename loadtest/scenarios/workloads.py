"""What the load sends: built-in texts and images, random-token prompts, or a user's file.

- Encoder APIs (classify, NER, embeddings) take texts: built-in realistic ones, or a file (`.txt`, one per
  line; `.jsonl`, a string or an object with "text" / "input" / "prompt" per line).
- Image classification takes PNG / JPEG files from a folder, or built-in generated ones.
- Generation APIs (chat, completions) take prompts:
  - builtin: plain words, a length drawn uniformly from a range;
  - random: random token ids of the model's tokenizer, decoded, with lengths drawn around a mean, the way
    `vllm bench serve --dataset-name random` builds them (so the two can be compared);
  - a file: JSONL prompts ({"prompt": ..., "max_tokens"?: N} or a plain string), or ShareGPT conversations
    (JSON list or JSONL of {"conversations": [{"from": "human" | "gpt", "value": ...}, ...]}): the
    conversation up to its last human turn is sent, and the reply that followed sets max_tokens (a prompt
    without one gets --output-len).
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.contract import AUDIO_SUFFIXES

TEXTS = [
    "I love this product, it works perfectly.",
    "Terrible. It broke after one day and support never answered.",
    "The package arrived on Tuesday.",
    "Great value, would buy again.",
    "Not what I expected; the colour is different from the photos and the fabric feels cheap.",
    "ok",
    "Shipping took three weeks, but the item itself is excellent and my kids use it every day.",
    "Anna Berg from Oslo called the support line at Acme Corp twice before anyone in Berlin answered.",
    "The refund for order 4471 was sent to John Smith in London on Monday.",
    "Maria works for Nordic Freight in Stockholm and reviews every invoice before it is paid.",
]
# Plain words that tokenizers (the test fixture's tiny one included) map to about one token each, so
# prompt length in words tracks prompt length in tokens.
WORDS = ("the a an and or of in on with about is can your orders package shipping refunds invoice questions "
         "answer answers help model served today tuesday quick brown fox jumps over lazy dog fine gateway "
         "how you i arrived attached day compatible").split()
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}


@dataclass
class Prompt:
    """One generation request's input: chat messages (a completion's prompt is their text) and its output
    length (None: the scenario's --output-len)."""

    messages: list[dict]
    max_tokens: int | None = None
    input_tokens: int | None = None  # known for random-token prompts

    @property
    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


def _check_file(path: Path) -> Path:
    if not path.exists():
        raise ValueError(f"dataset {path} does not exist")
    return path


def read_texts(path: Path) -> list[str]:
    """Texts from a `.txt` (one per line) or `.jsonl` file; blank lines are skipped."""
    lines = [line for line in _check_file(path).read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    texts = []
    for number, line in enumerate(lines, 1):
        item = json.loads(line)
        text = item if isinstance(item, str) else next((item[k] for k in ("text", "input", "prompt") if k in item), None)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}:{number}: expected a string or an object with a 'text' string")
        texts.append(text)
    if not texts:
        raise ValueError(f"{path} holds no texts")
    return texts


def builtin_images(count: int = 6, size: int = 48) -> list[bytes]:
    """Small PNGs of solid colours with a darker square: real images that any image model accepts."""
    from PIL import Image, ImageDraw

    rng = random.Random(0)
    images = []
    for _ in range(count):
        colour = tuple(rng.randrange(256) for _ in range(3))
        image = Image.new("RGB", (size, size), colour)
        ImageDraw.Draw(image).rectangle((size // 4, size // 4, size // 2, size // 2), fill=tuple(c // 2 for c in colour))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return images


def read_images(folder: Path) -> list[bytes]:
    files = sorted(p for p in _check_file(folder).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"{folder} holds no .png / .jpg images")
    return [p.read_bytes() for p in files]


@dataclass(frozen=True)
class Audio:
    """One audio file the speech scenarios upload, and its length (read with soundfile)."""

    name: str
    data: bytes
    seconds: float


def read_audio(folder: Path) -> list[Audio]:
    import soundfile

    files = sorted(p for p in _check_file(folder).iterdir() if p.suffix.lower() in AUDIO_SUFFIXES)
    if not files:
        raise ValueError(f"{folder} holds no {' / '.join(AUDIO_SUFFIXES)} files")
    found = []
    for path in files:
        try:
            info = soundfile.info(str(path))
        except RuntimeError as exc:
            raise ValueError(f"{path} is not audio soundfile reads: {exc}") from None
        found.append(Audio(path.name, path.read_bytes(), info.frames / info.samplerate))
    return found


def images_base64(folder: Path | None) -> list[str]:
    return [base64.b64encode(b).decode() for b in (read_images(folder) if folder else builtin_images())]


def builtin_prompts(rng: random.Random, count: int, words: tuple[int, int]) -> list[Prompt]:
    return [Prompt([{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(*words)))}])
            for _ in range(count)]


def length_range(mean: int, ratio: float) -> tuple[int, int]:
    """vLLM's random dataset: lengths drawn uniformly from [floor(mean(1-r)), ceil(mean(1+r))]."""
    if not 0 <= ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    return max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))


def random_token_prompts(tokenizer_file: Path, count: int, input_len: int, output_len: int, ratio: float,
                         seed: int) -> list[Prompt]:
    """Prompts of random tokens, as `vllm bench serve --dataset-name random` makes them: token ids drawn from
    the vocabulary without special tokens, decoded, re-encoded and cut or topped up until the text encodes to
    the drawn length. `input_len` counts the special tokens the server adds (a BOS), as vLLM's does."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(_check_file(tokenizer_file)))
    specials = {t.id if hasattr(t, "id") else t for t in tokenizer.get_added_tokens_decoder()}
    allowed = np.array(sorted(set(range(tokenizer.get_vocab_size())) - specials))
    added = len(tokenizer.encode("", add_special_tokens=True).ids)
    rng = np.random.default_rng(seed)
    in_low, in_high = length_range(max(1, input_len - added), ratio)
    out_low, out_high = length_range(output_len, ratio)
    prompts = []
    for _ in range(count):
        target = int(rng.integers(in_low, in_high + 1))
        ids = allowed[rng.integers(0, len(allowed), size=target)].tolist()
        for _attempt in range(10):  # decoding and encoding again can merge or split tokens
            ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False).ids
            if len(ids) == target:
                break
            ids = ids[:target] if len(ids) > target else ids + allowed[rng.integers(0, len(allowed), target - len(ids))].tolist()
        text = tokenizer.decode(ids)
        prompts.append(Prompt([{"role": "user", "content": text}], max_tokens=int(rng.integers(out_low, out_high + 1)),
                              input_tokens=len(tokenizer.encode(text, add_special_tokens=True).ids)))
    return prompts


def _sharegpt(item: dict, where: str) -> Prompt:
    turns = item.get("conversations") or item.get("conversation")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: expected 'conversations': [{{'from': 'human', 'value': ...}}, ...]")
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    messages = [{"role": roles.get(t.get("from") or t.get("role"), "user"), "content": t.get("value") or t.get("content") or ""}
                for t in turns]
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError(f"{where}: the conversation has no human turn")
    reply = messages[last_user + 1]["content"] if last_user + 1 < len(messages) else ""
    # Without the model's tokenizer, a reply's length in words stands for its length in tokens.
    return Prompt(messages[:last_user + 1], max_tokens=max(1, len(reply.split())) if reply else None)


def read_prompts(path: Path) -> list[Prompt]:
    """Prompts from a JSONL file of prompts or a ShareGPT file (JSON list or JSONL of conversations)."""
    text = _check_file(path).read_text()
    if path.suffix == ".json":
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of ShareGPT conversations")
        return [_sharegpt(item, f"{path}[{i}]") for i, item in enumerate(items)]
    prompts = []
    for number, line in enumerate((l for l in text.splitlines() if l.strip()), 1):
        item, where = json.loads(line), f"{path}:{number}"
        if isinstance(item, str):
            prompts.append(Prompt([{"role": "user", "content": item}]))
        elif isinstance(item, dict) and ("conversations" in item or "conversation" in item):
            prompts.append(_sharegpt(item, where))
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(Prompt([{"role": "user", "content": item["prompt"]}], max_tokens=item.get("max_tokens")))
        else:
            raise ValueError(f"{where}: expected a string, {{'prompt': ...}} or a ShareGPT conversation")
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def system_prompt(seed: int, words: int) -> str:
    """A system prompt of `words` words, the same for every process of a run with this seed."""
    rng = random.Random(f"system-{seed}")
    return " ".join(rng.choices(WORDS, k=words))
