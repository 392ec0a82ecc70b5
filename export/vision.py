"""The image pre-processing of an `image-classification` or `object-detection` export: the checkpoint's
image-processor settings, turned into the settings of the Triton pre-processing model
(`triton/python_models/image_preprocess/`), and the transformers reference it is checked against.

Supported: for classification the processors of ViT (also Swin and others that reuse it), DeiT, BEiT, BiT
(DINOv2) and ConvNeXt (also ResNet and RegNet); for detection those of DETR, Conditional DETR and Deformable
DETR; in any of their saved spellings (`...ImageProcessor`, `...ImageProcessorFast`, `...ImageProcessorPil`,
legacy `...FeatureExtractor`). The reference is the PIL backend of transformers, the one the pre-processing
model reproduces.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from core.tasks import IMAGE_CLASSIFICATION, OBJECT_DETECTION

from .checkpoint import IMAGE_PROCESSOR_FILE as PREPROCESSOR_CONFIG, read_json
from .exceptions import ExportError
from .triton.python_models.image_preprocess.imaging import Preprocess

SUPPORTED_PROCESSORS = (
    "ViTImageProcessor",
    "DeiTImageProcessor",
    "BeitImageProcessor",
    "BitImageProcessor",
    "ConvNextImageProcessor",
)
# DETR's resize keeps the aspect ratio (shortest / longest edge); a batch of one image needs no padding. RT-DETR's
# resizes to a fixed height and width.
DETECTION_PROCESSORS = ("DetrImageProcessor", "ConditionalDetrImageProcessor", "DeformableDetrImageProcessor",
                        "RTDetrImageProcessor", "YolosImageProcessor")
# YOLOS cuts DETR's resized sides down to a multiple of its patch size (transformers' get_size_with_aspect_ratio_yolos).
YOLOS_SIZE_MULTIPLE = 16
PROCESSORS = {IMAGE_CLASSIFICATION: SUPPORTED_PROCESSORS, OBJECT_DETECTION: DETECTION_PROCESSORS}
_BILINEAR = 2  # what transformers' PIL backend resizes with when `resample` is unset


def _canonical(name: str) -> str:
    """`ViTImageProcessorFast` / `...Pil` / `ViTFeatureExtractor` -> `ViTImageProcessor`."""
    name = name.replace("FeatureExtractor", "ImageProcessor")
    for suffix in ("Fast", "Pil"):
        if name.endswith("ImageProcessor" + suffix):
            name = name[: -len(suffix)]
    return name


def _unsupported(name: str, task: str) -> ExportError:
    return ExportError(f"image processor {name!r} is not supported for {task}; supported: {', '.join(PROCESSORS[task])}")


def _load_processor(checkpoint_path: Path):
    """The transformers PIL-backend processor of the checkpoint (the one pipelines use without torchvision)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(checkpoint_path), backend="pil")
    except Exception as exc:  # transformers raises ValueError / OSError / KeyError for damaged configs
        raise ExportError(f"transformers cannot load {PREPROCESSOR_CONFIG}: {exc}") from exc


def _triple(value, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * 3  # transformers repeats a scalar mean/std over the channels
    values = [float(v) for v in value]
    if len(values) != 3:
        raise ExportError(f"{PREPROCESSOR_CONFIG}: {name} has {len(values)} values; an RGB model needs 3")
    return values


def read_image_processor(checkpoint_path: Path, task: str = IMAGE_CLASSIFICATION) -> dict:
    """The settings of the pre-processing model, from the checkpoint's `preprocessor_config.json`.

    Missing keys take the processor class's defaults, as transformers loads them.

    Args:
        checkpoint_path: the fine-tuned checkpoint folder.
        task: image-classification or object-detection (which processors are supported).

    Returns:
        The settings dict `imaging.Preprocess` takes (JSON-serialisable; see imaging.py for the keys).

    Raises:
        ExportError: no preprocessor_config.json, an unsupported processor type, or settings that do not
            give a fixed output size.
    """
    checkpoint_path = Path(checkpoint_path)
    config_path = checkpoint_path / PREPROCESSOR_CONFIG
    if not config_path.is_file():
        raise ExportError(f"{task} needs preprocessor_config.json beside the model; "
                          "save it with image_processor.save_pretrained")
    supported = PROCESSORS[task]
    raw = read_json(config_path, "image processor config")
    declared = raw.get("image_processor_type") or raw.get("feature_extractor_type")
    if not declared:
        raise ExportError(f"{PREPROCESSOR_CONFIG} names no image_processor_type; supported: {', '.join(supported)}")
    if _canonical(declared) not in supported:
        raise _unsupported(declared, task)

    processor = _load_processor(checkpoint_path)
    kind = _canonical(type(processor).__name__)
    if kind not in supported:
        raise _unsupported(type(processor).__name__, task)
    if task == OBJECT_DETECTION:
        if getattr(processor, "pad_size", None):
            raise ExportError(f"{PREPROCESSOR_CONFIG}: pad_size (padding every image to one size) is not supported")
    elif getattr(processor, "do_pad", None):
        raise ExportError(f"{PREPROCESSOR_CONFIG}: do_pad is not supported for image-classification")

    size = {k: v for k, v in dict(processor.size).items() if v is not None} if processor.size is not None else None
    resample = processor.resample if processor.resample is not None else _BILINEAR
    settings = {
        "image_processor_type": kind,
        "do_convert_rgb": bool(getattr(processor, "do_convert_rgb", None)),
        "do_resize": bool(processor.do_resize),
        "size": size,
        "crop_pct": float(processor.crop_pct) if kind == "ConvNextImageProcessor" and processor.crop_pct else None,
        "resample": int(resample),
        "do_center_crop": bool(getattr(processor, "do_center_crop", False)),
        "crop_size": dict(processor.crop_size) if getattr(processor, "do_center_crop", False) and processor.crop_size else None,
        "do_rescale": bool(processor.do_rescale),
        "rescale_factor": float(processor.rescale_factor),
        "do_normalize": bool(processor.do_normalize),
        "image_mean": _triple(processor.image_mean, "image_mean") if processor.do_normalize else None,
        "image_std": _triple(processor.image_std, "image_std") if processor.do_normalize else None,
    }
    if kind == "YolosImageProcessor" and settings["do_resize"] and size and "longest_edge" in size:
        settings["size_multiple"] = YOLOS_SIZE_MULTIPLE
    if kind == "ConvNextImageProcessor" and settings["do_resize"] and settings["crop_pct"] is None:
        raise ExportError(f"{PREPROCESSOR_CONFIG}: ConvNeXt resizing needs crop_pct")
    try:
        preprocess = Preprocess(settings)
    except ValueError as exc:
        raise ExportError(f"{PREPROCESSOR_CONFIG} ({kind}): {exc}") from exc
    settings["height"], settings["width"] = preprocess.height, preprocess.width
    return settings


def _pattern(rng: np.random.RandomState, height: int, width: int, channels: int = 3) -> np.ndarray:
    """A smooth gradient with edges and noise (resize filters disagree most on edges)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = [127 + 120 * np.sin(x / (width / 6 + 1) + c) * np.cos(y / (height / 4 + 1) - c) for c in range(channels)]
    image = np.stack(base, axis=-1)
    image[(x.astype(int) // 16 + y.astype(int) // 16) % 2 == 0] *= 0.6  # a checkerboard of hard edges
    image += rng.normal(0, 12, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def _encode(image, fmt: str, **kwargs) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def sample_images(saturating: bool = True) -> list[bytes]:
    """Deterministic synthetic PNG/JPEG images for parity checks: landscape, portrait, panorama and tiny
    sizes; RGB, RGBA, LA, palette and RGB with colour-keyed transparency, grayscale, 16-bit grayscale
    (a featureless gradient, left out when not `saturating`), CMYK; EXIF-rotated JPEG and PNG."""
    from PIL import Image

    rng = np.random.RandomState(1234)
    rgba = np.concatenate([_pattern(rng, 203, 97), rng.randint(0, 256, (203, 97, 1)).astype(np.uint8)], axis=-1)
    rgba[::7, :, 3] = 0  # transparent rows keep their colour: load_image drops alpha, it does not composite
    exif_rotated = Image.Exif()
    exif_rotated[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    exif_flipped = Image.Exif()
    exif_flipped[0x0112] = 3  # Orientation: rotate 180
    palette = Image.fromarray(_pattern(rng, 48, 64)).quantize(colors=32)
    palette.info["transparency"] = 0
    keyed = _pattern(rng, 77, 59) // 32 * 32  # few colours, so that the tRNS colour key hits many pixels
    sixteen = (np.linspace(0, 65535, 90 * 70).reshape(90, 70)).astype(np.uint16)
    return [
        _encode(_pattern(rng, 480, 640), "PNG"),
        _encode(_pattern(rng, 500, 300), "JPEG", quality=90),
        _encode(_pattern(rng, 240, 400), "JPEG", quality=85, exif=exif_rotated.tobytes()),
        _encode(_pattern(rng, 150, 211), "PNG", exif=exif_flipped.tobytes()),
        _encode(rgba, "PNG"),
        _encode(_pattern(rng, 150, 150, channels=1)[..., 0], "PNG"),
        _encode(_pattern(rng, 61, 83, channels=2), "PNG"),
        _encode(palette, "PNG", transparency=0),
        _encode(keyed, "PNG", transparency=tuple(int(v) for v in keyed[3, 5])),
        *([_encode(Image.fromarray(sixteen), "PNG")] if saturating else []),
        _encode(Image.fromarray(_pattern(rng, 90, 120)).convert("CMYK"), "JPEG", quality=90),
        _encode(_pattern(rng, 90, 800), "PNG"),
        _encode(_pattern(rng, 5, 7), "PNG"),
    ]


def reference_pixels(checkpoint_path: Path, images: list[bytes]) -> np.ndarray:
    """What transformers' image pipelines feed the model for each image: `load_image` (EXIF transpose, RGB) then
    the checkpoint's PIL-backend image processor. float32 [3, H, W] each (sizes differ for DETR)."""
    from PIL import Image
    from transformers.image_utils import load_image

    processor = _load_processor(Path(checkpoint_path))
    pixels = []
    for data in images:
        image = load_image(Image.open(io.BytesIO(data)))
        pixels.append(np.asarray(processor(images=image, return_tensors="np")["pixel_values"][0], dtype=np.float32))
    return pixels
