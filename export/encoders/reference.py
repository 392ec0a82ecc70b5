"""An encoder export's reference set (core/reference.py): the probes or the eval set, with what transformers (and
sentence-transformers, for an embedder saved by it) answers on them from the checkpoint as trained."""

from __future__ import annotations

import base64
import logging
from pathlib import Path

import numpy as np

from core.reference import Item, ReferenceSet, fingerprint
from core.tasks import (FEATURE_EXTRACTION, IMAGE_CLASSIFICATION, OBJECT_DETECTION, TEXT_CLASSIFICATION,
                        TOKEN_CLASSIFICATION)

from ..exceptions import ExportError
from ..reference import eval_items, export_drift, versions

log = logging.getLogger(__name__)


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
                 else "") + versions("transformers")
    return ReferenceSet(
        task=task, framework=framework + (", peft" if _is_peft(reference) else ""), source=str(ckpt.path.resolve()),
        made_from=str(eval_set) if eval_set else "probes", labels=ckpt.labels if task != FEATURE_EXTRACTION else None,
        tokenizer=None if image else fingerprint(inputs.serving.to_str()), variant=parity.get("variant", "fp32"),
        drift=export_drift(parity), settings=settings, items=[i.model_copy(update={"expect": e}) for i, e in zip(items, expected)])


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

    from ..vision import reference_pixels

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

    from ..detection.detr import pipeline_detections

    found = pipeline_detections(ckpt.path, [_image_bytes(i) for i in items], DETECTION_DEFAULTS["conf"])
    return [{"detections": [[*map(float, box), float(score), int(label)] for score, label, box in image]}
            for image in found]
