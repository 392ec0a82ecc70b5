"""The image-classifier fixture: a tiny ViT (or ConvNeXt / ResNet) that learnt the dominant colour of noisy images,
trained until it names the colour of its probes with a margin (training.py)."""

from __future__ import annotations

import io
import random
from pathlib import Path

from .training import PROBABILITY_MARGIN, Property, margin_shortfall, save, train_until

IMAGE_LABELS = ["red", "green", "blue"]
# What the classifier's build checks, and tests read: solid 48x40 images in these encodings, labelled with a lead of
# PROBABILITY_MARGIN (JPEG's colour loss included).
IMAGE_PROBES = [((230, 20, 30), "PNG", "red"), ((10, 220, 40), "JPEG", "green"), ((20, 30, 240), "PNG", "blue")]


def solid_image(rgb: tuple[int, int, int], fmt: str) -> bytes:
    """A solid 48x40 image of colour `rgb`, encoded as `fmt` (PNG or JPEG)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (48, 40), rgb).save(buffer, fmt)
    return buffer.getvalue()


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


def _colour_property(processor) -> Property:
    from PIL import Image

    images = [Image.open(io.BytesIO(solid_image(rgb, fmt))).convert("RGB") for rgb, fmt, _ in IMAGE_PROBES]

    def shortfalls(model) -> list[str]:
        probs = model(pixel_values=processor(images=images, return_tensors="pt")["pixel_values"]).logits.softmax(-1)
        return [s for (rgb, fmt, label), row in zip(IMAGE_PROBES, probs)
                if (s := margin_shortfall(f"{fmt} {rgb}", row, IMAGE_LABELS.index(label), IMAGE_LABELS,
                                          PROBABILITY_MARGIN))]

    return Property(f"names the colour of each of IMAGE_PROBES with a lead of {PROBABILITY_MARGIN}", shortfalls)


def write_image_classifier(out: str | Path, *, arch: str = "vit", seed: int = 0, train_steps: int = 40,
                           rounds: int = 5) -> Path:
    """Write a tiny fine-tuned image classifier (labels red / green / blue) with its image processor to `out`.

    arch: vit (ViTImageProcessor: resize to 32x32), convnext or resnet (ConvNextImageProcessor:
    shortest edge 32 at crop_pct 0.875, then a centre crop). Trained on noisy colour images in rounds of
    `train_steps` until it names the colour of IMAGE_PROBES with a margin."""
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

    train_until(model, batch_loss, _colour_property(processor), name=f"{arch} image classifier", steps=train_steps,
                lr=3e-3, rounds=rounds)
    return save(out, model, processor, f"# tiny-{arch}-colours (rtxserve fixture)\n\nLabels {', '.join(IMAGE_LABELS)}: "
                "the dominant colour channel. For tests only.\n")
