"""The model inputs of an encoder export, made exactly as the entry's first Triton step will make them:
token tensors from texts (the checkpoint's Rust tokenizer) or pixel values from encoded images (the
checkpoint's image-processor settings). Each kind gives the ONNX export its sample, the parity check
its cases, and the Triton entry its arguments.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import numpy as np

from ..exceptions import ExportError
from ..tensorrt.plan import full_batches
from .task_specs import Checkpoint

log = logging.getLogger(__name__)

# Varied lengths, punctuation, non-ASCII, and one text longer than any small model's maximum length so
# that truncation is part of what parity covers.
SAMPLE_TEXTS = [
    "I love this product, it works perfectly.",
    "Terrible. It broke after one day!",
    "The package arrived on Tuesday.",
    "Das Essen war großartig — très bien, 👍",
    "ok",
    " ".join(["a very long review that goes on and on"] * 80),
]
# How far the served pre-processing may be from transformers' image processor (it matches exactly today).
PIXEL_ATOL = 1e-4


def _load_tokenizer(ckpt: Checkpoint):
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt.path, use_fast=True)
    except Exception as exc:
        raise ExportError(f"cannot load the tokenizer in {ckpt.path}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ExportError(f"the tokenizer in {ckpt.path} has no fast (Rust) version; Triton serving needs tokenizer.json")
    return tokenizer


def _input_names(tokenizer, model) -> list[str]:
    accepted = inspect.signature(model.forward).parameters
    if hasattr(model, "model"):  # a task wrapper: the inputs the transformer inside takes
        accepted = set(accepted) & set(inspect.signature(model.model.forward).parameters)
    names = [n for n in tokenizer.model_input_names if n in accepted]
    if "input_ids" not in names:
        raise ExportError(f"tokenizer inputs {tokenizer.model_input_names} do not include input_ids")
    return ["input_ids"] + [n for n in names if n != "input_ids"]


def _max_length(tokenizer, config: dict, requested: int | None) -> int:
    limit = int(config.get("max_position_embeddings") or 512)
    # RoBERTa-style position ids start after the padding index: two positions are not usable.
    if config.get("model_type") in {"roberta", "xlm-roberta", "camembert"}:
        limit -= 2
    model_max = getattr(tokenizer, "model_max_length", limit) or limit
    default = min(limit, int(model_max) if model_max < 1e9 else limit)
    if requested is None:
        return default
    if not 1 <= requested <= limit:
        raise ExportError(f"--max-length {requested} is outside 1..{limit} (the model's position limit)")
    return requested


class TextInputs:
    """Token tensors from texts, through the serving tokenizer (checked against the checkpoint's)."""

    what = "texts"

    def __init__(self, ckpt: Checkpoint, model, max_length: int | None, samples: list[str] | None):
        from tokenizers import Tokenizer

        self.tokenizer = _load_tokenizer(ckpt)
        self.names = _input_names(self.tokenizer, model)
        self.max_length = _max_length(self.tokenizer, ckpt.config, max_length)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # The Rust tokenizer exactly as the Triton tokenizer model will configure it.
        self.serving = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
        self.serving.enable_truncation(max_length=self.max_length)
        self.serving.enable_padding(pad_id=self.pad_id)
        self.samples = samples or SAMPLE_TEXTS
        self.notes: list[str] = []

    def describe(self) -> str:
        return f"inputs {', '.join(self.names)}, max length {self.max_length}"

    def sample(self) -> dict[str, np.ndarray]:
        enc = self.tokenizer(SAMPLE_TEXTS[:2], padding=True, return_tensors="np")
        return {n: enc[n].astype(np.int64) for n in self.names}

    def cases(self) -> list[dict[str, np.ndarray]]:
        """Each sample alone, then all together (padding inside a batch is part of what is checked)."""
        out = []
        for case in [[t] for t in self.samples] + [self.samples]:
            enc = self.tokenizer(case, padding=True, truncation=True, max_length=self.max_length, return_tensors="np")
            served = self.serving.encode_batch(case)
            if any(list(e.ids) != list(row) for e, row in zip(served, enc["input_ids"])):
                raise ExportError("the serving tokenizer (tokenizer.json) encodes differently from the checkpoint's tokenizer")
            out.append({n: enc[n].astype(np.int64) for n in self.names})
        self.notes = ["serving tokenizer matched the checkpoint tokenizer on every sample"]
        return out

    def plan_inputs(self) -> dict:
        """Input name -> fixed non-batch dims, None for [batch, seq] token tensors (for TensorRT profiles)."""
        return {n: None for n in self.names}

    def calibration(self, texts: list[str], batch: int) -> list[dict[str, np.ndarray]]:
        """INT8 calibration batches of one shape, as served on GPUs (padded to the max length)."""
        out = []
        for chunk in full_batches(texts, batch):
            enc = self.tokenizer(chunk, padding="max_length", truncation=True, max_length=self.max_length,
                                 return_tensors="np")
            out.append({n: enc[n].astype(np.int64) for n in self.names})
        return out

    def entry_kwargs(self) -> dict:
        return {"tokenizer_json": self.serving.to_str(), "input_names": self.names, "max_length": self.max_length,
                "pad_token_id": self.pad_id}

    def activations(self, graph: Path) -> dict:
        return {}  # sized from the model's dimensions (deploy/plan.py)

    def metadata(self) -> dict:
        return {"inputs": self.names, "max_length": self.max_length}


class ImageInputs:
    """Pixel values from encoded PNG / JPEG images, through the served pre-processing
    (triton/python_models/image_preprocess/imaging.py), checked against transformers' image processor."""

    what = "images"

    def __init__(self, ckpt: Checkpoint, samples: list[bytes] | None, *, plan: bool = False):
        """plan: the graph is served as a TensorRT plan, whose profile takes sides up to the processor's longest edge
        where the size varies (the served pre-processing then refuses what would pass it)."""
        from ..triton.python_models.image_preprocess.imaging import Preprocess
        from ..vision import read_image_processor, sample_images

        self.path = ckpt.path
        self.settings = read_image_processor(ckpt.path, ckpt.task)
        self.preprocess = Preprocess(self.settings)
        # DETR keeps each image's aspect ratio: pixel tensors differ in size and go through one at a time.
        self.varies = -1 in self.preprocess.shape
        if plan and self.varies:
            self.settings["max_side"] = self.preprocess.size["longest_edge"]
            self.preprocess = Preprocess(self.settings)
        self.names = ["pixel_values"]
        self.samples, self.left_out = self._servable(samples or sample_images())
        self.notes: list[str] = list(self.left_out)

    def _servable(self, samples: list[bytes]) -> tuple[list[bytes], list[str]]:
        """The sample images this processor can take, and a note for each it cannot: one that its resize leaves no
        pixels on a side (YOLOS' on an extreme aspect ratio), which transformers' processor fails on too."""
        from ..triton.python_models.image_preprocess.imaging import ResizedAway

        kept, notes = [], []
        for i, data in enumerate(samples):
            try:
                self.preprocess(data)
            except ResizedAway as exc:
                notes.append(f"sample image {i} left out: {exc}")
                continue
            except ValueError:
                pass  # _pixels says what is wrong with it, where it is used
            kept.append(data)
        return kept, notes

    def describe(self) -> str:
        return f"pixel_values {list(self.preprocess.shape)} ({self.settings['image_processor_type']} settings)"

    def _pixels(self, images: list[bytes], what: str = "sample") -> np.ndarray:
        out = []
        for i, data in enumerate(images):
            try:
                out.append(self.preprocess(data))
            except ValueError as exc:
                raise ExportError(f"{what} image {i}: {exc}") from exc
        return np.stack(out)

    def sample(self) -> dict[str, np.ndarray]:
        return {"pixel_values": self._pixels(self.samples[:1 if self.varies else 2])}

    def cases(self) -> list[dict[str, np.ndarray]]:
        """Each sample alone, then all together; the served pre-processing is first checked against
        transformers' image processor on the same images."""
        from ..vision import reference_pixels

        served = [self._pixels([image]) for image in self.samples]
        reference = reference_pixels(self.path, self.samples)
        diff = max(float(np.abs(s[0] - r).max()) if s[0].shape == r.shape else float("inf")
                   for s, r in zip(served, reference))
        if diff > PIXEL_ATOL:
            raise ExportError(f"the served image pre-processing differs from transformers' image processor by {diff:.3g} "
                              f"(max abs, tolerance {PIXEL_ATOL}); this image-processor configuration is not reproduced")
        self.notes = [*self.left_out, f"served pre-processing matched transformers' image processor on "
                      f"{len(self.samples)} images (max abs diff {diff:.3g})"]
        together = [] if self.varies else [{"pixel_values": np.concatenate(served)}]
        return [{"pixel_values": pixels} for pixels in served] + together

    def plan_inputs(self) -> dict:
        return {"pixel_values": self.preprocess.shape}

    def plan_side(self) -> tuple[int, int, int] | None:
        """Where the size varies, the plan's (min, opt, max) image side: every side the pre-processing makes up to
        `max_side` (a sliver's short side may resize to 1 pixel), optimised for a square's (a calibration image's)."""
        from PIL import Image

        if not self.varies:
            return None
        return 1, self._square(Image.new("RGB", (1, 1))).shape[-1], self.settings["max_side"]

    def _square(self, image) -> np.ndarray:
        """An image's centre square, pre-processed: every image gives one shape (the processor's square)."""
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        return self.preprocess.pixels(image.crop((left, top, left + side, top + side)))

    def calibration(self, images: list[bytes], batch: int) -> list[dict[str, np.ndarray]]:
        """INT8 calibration batches of one shape (TensorRT calibrates at one): where the size varies, each image's
        centre square, which the processor resizes to one size, as it would not the whole image."""
        if not self.varies:
            return [{"pixel_values": self._pixels(chunk, "calibration")} for chunk in full_batches(images, batch)]
        from ..triton.python_models.image_preprocess.imaging import decode

        squares = []
        for i, data in enumerate(images):
            try:
                squares.append(self._square(decode(data, self.preprocess.max_pixels)))
            except ValueError as exc:
                raise ExportError(f"calibration image {i}: {exc}") from exc
        return [{"pixel_values": np.stack(chunk)} for chunk in full_batches(squares, batch)]

    def entry_kwargs(self) -> dict:
        return {"image_processor": self.settings, "pixel_shape": self.preprocess.shape}

    def metadata(self) -> dict:
        return {"inputs": self.names, "image_processor": self.settings}

    def largest(self) -> tuple[int, int, int]:
        """The largest pixel tensor of one image: the fixed shape, or (DETR's resize) the shortest edge by the longest."""
        if not self.varies:
            return tuple(self.preprocess.shape)
        size = self.preprocess.size
        return (3, size["shortest_edge"], size["longest_edge"])

    def activations(self, graph: Path) -> dict:
        from ..activations import graph_activations

        return {"graph_activations": graph_activations(graph, "pixel_values", self.largest())}


def read_sample_images(folder: Path) -> list[bytes]:
    """Every PNG / JPEG file in `folder` (sorted by name), for parity checks."""
    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in {".png", ".jpg", ".jpeg"})
    if not files:
        raise ExportError(f"{folder} holds no .png / .jpg / .jpeg files")
    return [p.read_bytes() for p in files]
