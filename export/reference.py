"""The reference set an export writes beside its artifact (core/reference.py): the inputs (the user's `--eval-set`, or
the probes the export already checks with) and what the training framework itself answers on them, from the checkpoint
as trained (an adapter through PEFT, unmerged), not from the exported artifact. `rtxserve eval` sends the same inputs
through a served box and compares its answers with these.
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path

import numpy as np

from core.reference import Item, ReferenceError, ReferenceSet, fingerprint, read_eval_set
from core.tasks import (FEATURE_EXTRACTION, IMAGE_CLASSIFICATION, OBJECT_DETECTION, TEXT_CLASSIFICATION,
                        TOKEN_CLASSIFICATION)

from .exceptions import ExportError

log = logging.getLogger(__name__)


def eval_items(eval_set: Path | None, task: str) -> list[Item] | None:
    """The user's eval set as items (inputs and gold, no answers yet), or None for the export's own probes."""
    if eval_set is None:
        return None
    try:
        return read_eval_set(eval_set, task)
    except ReferenceError as exc:
        raise ExportError(str(exc)) from None


def _versions(*names: str) -> str:
    import importlib.metadata

    return ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names)


def _drift(parity: dict) -> dict[str, float]:
    """What export measured between the served variant and the framework, over its outputs: the worst of each."""
    outputs = list(parity.get("outputs", {}).values())
    if not outputs:
        return {}
    return {"max_abs_diff": max(o["max_abs_diff"] for o in outputs), "min_cosine": min(o["min_cosine"] for o in outputs),
            "top1_agreement": min(o["top1_agreement"] for o in outputs)}


def encoder_reference(task: str, ckpt, reference, inputs, parity: dict, *, aggregation: str,
                      eval_set: Path | None, multi_label: bool) -> ReferenceSet:
    """The framework's answers for an encoder export: `reference` is the model the export was checked against (the
    checkpoint, or base + adapter unmerged), wrapped for the task; `inputs` its TextInputs / ImageInputs."""
    import torch

    items = eval_items(eval_set, task)
    image = task in (IMAGE_CLASSIFICATION, OBJECT_DETECTION)
    if items is None:
        items = [Item(input={"image": base64.b64encode(s).decode()} if image else s) for s in inputs.samples]
    elif task in (TEXT_CLASSIFICATION, IMAGE_CLASSIFICATION):
        _check_gold_labels(items, ckpt.labels, eval_set)
    answer = {TEXT_CLASSIFICATION: _text_logits, IMAGE_CLASSIFICATION: _image_logits, TOKEN_CLASSIFICATION: _entities,
              FEATURE_EXTRACTION: _embeddings, OBJECT_DETECTION: _detections}[task]
    with torch.no_grad():
        expected = answer(ckpt, reference, inputs, items, aggregation=aggregation)
    settings = {"max_length": inputs.max_length} if not image else {}
    if task == TOKEN_CLASSIFICATION:
        settings["aggregation"] = aggregation
    if task in (TEXT_CLASSIFICATION, IMAGE_CLASSIFICATION):
        settings["multi_label"] = multi_label
    if task == OBJECT_DETECTION:
        from core.contract import DETECTION_DEFAULTS

        settings["conf"] = DETECTION_DEFAULTS["conf"]
    framework = ("sentence-transformers, " if task == FEATURE_EXTRACTION and _sentence_transformers(ckpt, reference)
                 else "") + _versions("transformers")
    return ReferenceSet(
        task=task, framework=framework + (", peft" if _is_peft(reference) else ""), source=str(ckpt.path.resolve()),
        made_from=str(eval_set) if eval_set else "probes", labels=ckpt.labels if task != FEATURE_EXTRACTION else None,
        tokenizer=None if image else fingerprint(inputs.serving.to_str()), variant=parity.get("variant", "fp32"),
        drift=_drift(parity), settings=settings, items=[i.model_copy(update={"expect": e}) for i, e in zip(items, expected)])


def _check_gold_labels(items: list[Item], labels: list[str], eval_set: Path) -> None:
    unknown = sorted({str(i.gold) for i in items if i.gold is not None and i.gold not in labels})
    if unknown:
        raise ExportError(f"{eval_set}: labels {', '.join(unknown)} are not the model's ({', '.join(labels)})")


def _is_peft(model) -> bool:
    inner = getattr(model, "model", model)
    return any(hasattr(m, "peft_config") for m in (model, inner))


def _unwrapped(reference):
    """The transformers (or PEFT) model inside a task wrapper."""
    return reference.model if hasattr(reference, "model") and not hasattr(reference, "config") else reference


def _text_logits(ckpt, reference, inputs, items: list[Item], **_) -> list[dict]:
    out = []
    for item in items:
        enc = inputs.tokenizer(item.input, truncation=True, max_length=inputs.max_length, return_tensors="pt")
        logits = _logits(reference(**{n: enc[n] for n in inputs.names}))
        out.append({"label": ckpt.labels[int(np.argmax(logits))], "logits": logits.tolist()})
    return out


def _logits(output) -> np.ndarray:
    first = output[0] if isinstance(output, tuple) else output.logits
    return first[0].float().numpy()


def _image_logits(ckpt, reference, inputs, items: list[Item], **_) -> list[dict]:
    import torch

    from .vision import reference_pixels

    pixels = reference_pixels(ckpt.path, [_image_bytes(i) for i in items])
    out = []
    for p in pixels:
        logits = _logits(reference(pixel_values=torch.from_numpy(p[None])))
        out.append({"label": ckpt.labels[int(np.argmax(logits))], "logits": logits.tolist()})
    return out


def _image_bytes(item: Item) -> bytes:
    return base64.b64decode(item.input["image"])


def _entities(ckpt, reference, inputs, items: list[Item], *, aggregation: str) -> list[dict]:
    """transformers' token-classification pipeline, as the served postprocess reproduces it."""
    from transformers import pipeline

    pipe = pipeline("token-classification", model=_unwrapped(reference), tokenizer=inputs.tokenizer,
                    aggregation_strategy=aggregation, device="cpu")
    out = []
    for item in items:
        found = pipe(item.input)
        out.append({"entities": [{"entity": e.get("entity_group", e.get("entity")), "score": float(e["score"]),
                                  "start": int(e["start"]), "end": int(e["end"]),
                                  "word": item.input[int(e["start"]):int(e["end"])]} for e in found]})
    return out


def _sentence_transformers(ckpt, reference) -> bool:
    return (ckpt.path / "modules.json").is_file() and not _is_peft(reference)


def _embeddings(ckpt, reference, inputs, items: list[Item], **_) -> list[dict]:
    """sentence-transformers' own encode where the checkpoint is its folder (cut at the entry's max length), else the
    checkpoint pooled as its 1_Pooling says (what export validated the graph against)."""
    texts = [i.input for i in items]
    if _sentence_transformers(ckpt, reference):
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(ckpt.path), device="cpu")
        st.max_seq_length = inputs.max_length
        vectors = st.encode(texts, convert_to_numpy=True, batch_size=1)
    else:
        vectors = []
        for text in texts:
            enc = inputs.tokenizer(text, truncation=True, max_length=inputs.max_length, return_tensors="pt")
            vectors.append(reference(**{n: enc[n] for n in inputs.names})[0][0].float().numpy())
    return [{"embedding": np.asarray(v, dtype=np.float32).tolist()} for v in vectors]


def _detections(ckpt, reference, inputs, items: list[Item], **_) -> list[dict]:
    """transformers' object-detection pipeline at the entry's default conf: [x1, y1, x2, y2, score, class id] rows."""
    from core.contract import DETECTION_DEFAULTS

    from .detection.detr import pipeline_detections

    found = pipeline_detections(ckpt.path, [_image_bytes(i) for i in items], DETECTION_DEFAULTS["conf"])
    return [{"detections": [[*map(float, box), float(score), int(label)] for score, label, box in image]}
            for image in found]


# LLMs: how long a continuation the reference holds, the top log-probabilities kept per position, and how much less
# likely (to the framework) a served token may be where the two part, for the parting to count as a near tie.
LLM_MAX_TOKENS, LLM_MAX_TOKENS_GOLD, LLM_TOP_LOGPROBS, LLM_TIE_LOGPROB = 32, 256, 5, 0.5


def llm_items(tokenizer, template: str | None, prompts: list[str], eval_set: Path | None) -> list[Item]:
    """The eval set's inputs, or the sample prompts: each as a chat turn where the model has a chat template (what a
    wrong template would change), and the first two as plain completions too (what the weights and tokenizer alone
    answer)."""
    from core.tasks import TEXT_GENERATION

    items = eval_items(eval_set, TEXT_GENERATION)
    if items is not None:
        return items
    chats = [Item(input={"messages": [{"role": "user", "content": p}]}) for p in prompts] if template else []
    return chats + [Item(input={"prompt": p}) for p in prompts[: 2 if template else len(prompts)]]


def llm_reference(model, tokenizer, template: str | None, items: list[Item], *, source: Path,
                  made_from: str, peft: bool = False) -> ReferenceSet:
    """The framework's greedy continuation of each item (a chat through `template`, the chat template the model was
    trained with; a prompt as vLLM's completions tokenize it), with the top log-probabilities at each position, from
    `model` (transformers, or base + adapter through PEFT) as it is loaded."""
    import torch

    eos = _eos_ids(model, tokenizer)
    longest = max((len(tokenizer(str(i.gold))["input_ids"]) for i in items if i.gold is not None), default=0)
    max_tokens = min(LLM_MAX_TOKENS_GOLD, longest + 8) if longest else LLM_MAX_TOKENS
    expected = []
    with torch.no_grad():
        for item in items:
            if "messages" in item.input:
                if not template:
                    raise ExportError("the eval set has chat messages, and the model has no chat template: give "
                                      "--chat-template, or prompts")
                text = tokenizer.apply_chat_template(item.input["messages"], chat_template=template,
                                                     add_generation_prompt=True, tokenize=False)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(item.input["prompt"])["input_ids"]
            expected.append(_greedy(model, tokenizer, ids, max_tokens, eos))
    return ReferenceSet(
        task="text-generation", framework=_versions("transformers", *(("peft",) if peft else ())), source=str(source),
        made_from=made_from, tokenizer=_tokenizer_fingerprint(tokenizer),
        settings={"max_tokens": max_tokens, "top_logprobs": LLM_TOP_LOGPROBS, "tie_logprob": LLM_TIE_LOGPROB,
                  "eos_token_ids": sorted(eos), "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")},
        items=[i.model_copy(update={"expect": e}) for i, e in zip(items, expected)])


def _eos_ids(model, tokenizer) -> set[int]:
    """The tokens that end a generation, as vLLM reads them: the tokenizer's end of sequence and the generation
    config's."""
    found = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    found |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return found


def _tokenizer_fingerprint(tokenizer) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return fingerprint(backend.to_str()) if backend is not None else None


def _greedy(model, tokenizer, ids: list[int], max_tokens: int, eos: set[int]) -> dict:
    """Greedy decoding with no processor (no repetition penalty, whatever generation_config.json says), its raw
    logits' top log-probabilities at each step."""
    import torch
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, num_beams=1, eos_token_id=sorted(eos) or None,
                              pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0),
                              output_logits=True, return_dict_in_generate=True)
    out = model.generate(input_ids=torch.tensor([ids], device=device),
                         attention_mask=torch.ones((1, len(ids)), dtype=torch.long, device=device), generation_config=config)
    new = out.sequences[0, len(ids):].tolist()
    top = []
    for logits in out.logits[: len(new)]:
        values, indices = torch.log_softmax(logits[0].float(), -1).topk(LLM_TOP_LOGPROBS)
        top.append([[int(i), float(v)] for i, v in zip(indices, values)])
    return {"token_ids": new, "tokens": [tokenizer.decode([t]) for t in new],
            "text": tokenizer.decode(new, skip_special_tokens=True), "top_logprobs": top}
