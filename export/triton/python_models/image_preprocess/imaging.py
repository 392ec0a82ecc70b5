"""Encoded image bytes -> the pixel values a Hugging Face vision classifier or detector, or an Ultralytics YOLO,
takes. NumPy + Pillow (and OpenCV for YOLO's letterbox, the library Ultralytics resizes with).

Copied beside `model.py` into `<name>_preprocess/1/` by `rtxserve export`; the export side imports it
too (settings validation, parity). It reproduces, operation for operation, what
`transformers.pipeline("image-classification")` does with the PIL image processors
(ViT / DeiT / BEiT / BiT / ConvNeXt, transformers 5.x):

* loading as `transformers.image_utils.load_image`: EXIF orientation applied, then `convert("RGB")`,
  which drops an alpha channel (no compositing). Pillow keeps a colour-keyed transparency (palette or
  tRNS PNGs) in `image.info`, and processors with `do_convert_rgb` (BiT) then composite those keyed
  pixels onto white, so this does too;
* resize on the uint8 PIL image (`image_transforms.resize` turns the uint8 array back into a PIL image
  without rescaling), output size of a shortest-edge resize truncated with `int()` as
  `get_resize_output_image_size`; ConvNeXt's rule: shortest edge < 384 resizes the shortest edge to
  `int(shortest_edge / crop_pct)` then center-crops to a square, >= 384 warps to a square; DETR's rule
  (shortest and longest edge: the short side to `shortest_edge` unless the long side would pass
  `longest_edge`, as `get_size_with_aspect_ratio`) keeps the aspect ratio, so its output size varies;
* center crop on uint8 (zero-padded where the image is smaller than the crop);
* rescale in float64 then cast to float32, normalise in float32 (mean and std as float32 arrays).

The result is bit-identical to the processor's on the same Pillow version.

Settings (a JSON object, written by `export.vision.read_image_processor`):
    image_processor_type  str, informational
    do_convert_rgb        bool: composite colour-keyed transparency onto white (transformers' convert_to_rgb)
    do_resize             bool
    size                  {"height": int, "width": int}, {"shortest_edge": int} or
                          {"shortest_edge": int, "longest_edge": int} (DETR: the output size varies)
    crop_pct              float or null; set (with shortest_edge) = ConvNeXt's resize rule
    resample              int, PIL filter code (0 nearest, 1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming)
    do_center_crop        bool
    crop_size             {"height": int, "width": int} or null
    do_rescale            bool
    rescale_factor        float
    do_normalize          bool
    image_mean, image_std [float, float, float]
    height, width         int, the output size (checked against the size the steps above give)
    max_pixels            int, optional: larger images are refused before decoding (default 50 M)
    max_side              int, optional, with an output size that varies: an image resized to a longer side is
                          refused (a TensorRT plan's optimisation profile takes sides up to it)
    letterbox             {"imgsz": int, "stride": int} or absent: Ultralytics' pre-processing instead of the
                          steps above (see `letterbox`); the output size follows the image's aspect ratio
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageOps

DEFAULT_MAX_PIXELS = 50_000_000
RESAMPLE_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
_ACCEPTED = ("PNG", "JPEG")
_KEYS = {"image_processor_type", "do_convert_rgb", "do_resize", "size", "crop_pct", "resample", "do_center_crop",
         "crop_size", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std", "height", "width",
         "max_pixels", "letterbox", "size_multiple", "max_side"}
# Ultralytics' LetterBox: the grey it pads with.
LETTERBOX_PAD = 114
# ConvNeXt evaluates at >= 384 by warping to a square, below it by resize + crop (as its processor).
_CONVNEXT_WARP_FROM = 384


def sniff_format(data: bytes) -> str:
    """The container format of `data` from its magic bytes ("PNG", "JPEG", "GIF", ...), for messages."""
    if not data:
        return "empty input"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    if data[:2] == b"BM":
        return "BMP"
    if data[4:12] in (b"ftypavif", b"ftypheic", b"ftypheix", b"ftypmif1"):
        return "AVIF/HEIF"
    return f"unrecognised data starting {data[:8].hex()}"


def decode(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode PNG or JPEG bytes into an upright RGB image, as transformers' `load_image` does.

    Raises:
        ValueError: not PNG/JPEG, larger than `max_pixels` (checked from the header, before the pixels
            are decoded: a decompression bomb is refused without allocating it), or undecodable
            (truncated, corrupt).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"image must be bytes, got {type(data).__name__}")
    data = bytes(data)
    kind = sniff_format(data)
    if kind not in _ACCEPTED:
        raise ValueError(f"image is not PNG or JPEG (got {kind})")
    try:
        image = Image.open(io.BytesIO(data), formats=[kind])
    except Image.DecompressionBombError as exc:
        raise ValueError(f"image too large: {exc}") from None
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, struct.error on bad headers
        raise ValueError(f"cannot read {kind} image: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ValueError(f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}")
    if width < 1 or height < 1:
        raise ValueError(f"image has no pixels ({width}x{height})")
    try:
        image.load()  # decode now so that truncation is an error here, not later
        image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except Exception as exc:
        raise ValueError(f"cannot decode {kind} image: {exc}") from None


def _size_dict(value, name: str, keys: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    if not isinstance(value, dict) or tuple(sorted(value)) not in {tuple(sorted(k)) for k in keys}:
        raise ValueError(f"{name} must have the keys {' or '.join(str(list(k)) for k in keys)}, got {value!r}")
    for key, v in value.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}.{key} must be a positive integer, got {v!r}")
    return dict(value)


def _triple(value, name: str) -> np.ndarray:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"{name} must be a list of 3 numbers (R, G, B), got {value!r}")
    return np.array([float(v) for v in value], dtype=np.float32)


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """(height, width) with the short side at `shortest_edge`, the long side truncated as transformers
    `get_resize_output_image_size(default_to_square=False)` does (Python float arithmetic, then int())."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """(height, width) as transformers' `get_size_with_aspect_ratio` (DETR's processors): the short side at `size`
    unless the long side would then pass `max_size`, in which case the long side is at `max_size`."""
    raw_size = None
    low, high = float(min(height, width)), float(max(height, width))
    if high / low * size > max_size:
        raw_size = max_size * low / high
        size = int(round(raw_size))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return int((raw_size if raw_size is not None else size) * height / width), size
    return size, int((raw_size if raw_size is not None else size) * width / height)


class ResizedAway(ValueError):
    """The resize leaves the image a shape the served model cannot take: no pixels on a side (YOLOS' multiple of 16
    under a sliver's short side), or a side over `max_side`."""


def size_with_aspect_ratio_multiple(height: int, width: int, size: int, max_size: int, multiple: int) -> tuple[int, int]:
    """(height, width) as transformers' `get_size_with_aspect_ratio_yolos` (YOLOS' processors): DETR's rule, its cases
    taken in YOLOS' order, then each side cut down to a multiple of `multiple` (its patch size, 16)."""
    raw_size = None
    low, high = float(min(height, width)), float(max(height, width))
    if high / low * size > max_size:
        raw_size = max_size * low / high
        size = int(round(raw_size))
    if width < height:
        out_w, out_h = size, int((raw_size if raw_size is not None else size) * height / width)
    elif (height <= width and height == size) or (width <= height and width == size):
        out_h, out_w = height, width
    else:
        out_h, out_w = size, int((raw_size if raw_size is not None else size) * width / height)
    return out_h - out_h % multiple, out_w - out_w % multiple


def center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' `center_crop` on an HWC array, zero padding where the image is smaller than the crop."""
    orig_h, orig_w = array.shape[:2]
    top = (orig_h - height) // 2
    left = (orig_w - width) // 2
    if top >= 0 and left >= 0 and top + height <= orig_h and left + width <= orig_w:
        return array[top:top + height, left:left + width]
    new_h, new_w = max(height, orig_h), max(width, orig_w)
    padded = np.zeros((new_h, new_w) + array.shape[2:], dtype=array.dtype)
    top_pad, left_pad = math.ceil((new_h - orig_h) / 2), math.ceil((new_w - orig_w) / 2)
    padded[top_pad:top_pad + orig_h, left_pad:left_pad + orig_w] = array
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]


def letterbox_geometry(height: int, width: int, imgsz: int, stride: int) -> tuple[int, int, int, int, int, int]:
    """Where an image lands in the tensor Ultralytics' predictor feeds a PyTorch (or dynamic ONNX) YOLO: LetterBox
    with `auto` (the least padding that makes each side a multiple of `stride`), centred, scaled up or down.

    Returns (resized height, resized width, top, bottom, left, right padding); the tensor is (resized + padding)."""
    r = min(imgsz / height, imgsz / width)
    new_w, new_h = max(round(width * r), 1), max(round(height * r), 1)
    dw, dh = (imgsz - new_w) % stride / 2, (imgsz - new_h) % stride / 2
    return new_h, new_w, round(dh - 0.1), round(dh + 0.1), round(dw - 0.1), round(dw + 0.1)


def letterbox(array: np.ndarray, imgsz: int, stride: int) -> np.ndarray:
    """An RGB uint8 [H, W, 3] image as Ultralytics' predictor prepares it: OpenCV's bilinear resize and a grey
    border (LetterBox), then 0-1 floats, float32 [3, H', W']."""
    import cv2

    new_h, new_w, top, bottom, left, right = letterbox_geometry(array.shape[0], array.shape[1], imgsz, stride)
    if (new_h, new_w) != array.shape[:2]:
        array = cv2.resize(array, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    array = cv2.copyMakeBorder(array, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(LETTERBOX_PAD,) * 3)
    return np.ascontiguousarray(array.transpose(2, 0, 1)).astype(np.float32) / np.float32(255)


class Preprocess:
    """Image bytes -> float32 [3, H, W] pixel values, configured once from a settings dict."""

    def __init__(self, settings: dict):
        unknown = set(settings) - _KEYS
        if unknown:
            raise ValueError(f"unknown image settings {sorted(unknown)}; valid: {sorted(_KEYS)}")
        s = settings
        self.max_pixels = int(s.get("max_pixels", DEFAULT_MAX_PIXELS))
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels}")
        self.letterbox = s.get("letterbox")
        if self.letterbox is not None:  # Ultralytics' steps, none of the image processor's
            if set(self.letterbox) != {"imgsz", "stride"} or not all(
                    isinstance(v, int) and v > 0 for v in self.letterbox.values()):
                raise ValueError(f"letterbox must be {{'imgsz': int, 'stride': int}}, got {self.letterbox!r}")
            self.height = self.width = -1
            return
        self.do_convert_rgb = bool(s.get("do_convert_rgb", False))
        self.do_resize = bool(s.get("do_resize", True))
        self.size = _size_dict(s.get("size"), "size", (("height", "width"), ("shortest_edge",),
                                                       ("shortest_edge", "longest_edge"))) if self.do_resize else None
        self.size_multiple = s.get("size_multiple")
        self.max_side = s.get("max_side")
        if self.max_side is not None and (not isinstance(self.max_side, int) or self.max_side < 1
                                          or not self.do_resize or "longest_edge" not in self.size):
            raise ValueError("max_side (a TensorRT plan's largest side) must be a positive int, with size "
                             f"{{'shortest_edge': N, 'longest_edge': M}}; got {self.max_side!r}")
        if self.size_multiple is not None and (not isinstance(self.size_multiple, int) or self.size_multiple < 1
                                               or not self.do_resize or "longest_edge" not in self.size):
            raise ValueError("size_multiple (YOLOS' resize) must be a positive int, with size {'shortest_edge': N, "
                             f"'longest_edge': M}}; got {self.size_multiple!r}")
        self.crop_pct = s.get("crop_pct")
        if self.crop_pct is not None:
            if not isinstance(self.crop_pct, (int, float)) or not 0 < self.crop_pct:
                raise ValueError(f"crop_pct must be a positive number, got {self.crop_pct!r}")
            if self.do_resize and "shortest_edge" not in self.size:
                raise ValueError("crop_pct (ConvNeXt's resize) needs size {'shortest_edge': N}")
        self.resample = s.get("resample", 2)
        if self.resample not in RESAMPLE_FILTERS:
            raise ValueError(f"resample must be a PIL filter code {RESAMPLE_FILTERS}, got {self.resample!r}")
        self.do_center_crop = bool(s.get("do_center_crop", False))
        self.crop_size = _size_dict(s.get("crop_size"), "crop_size", (("height", "width"),)) \
            if self.do_center_crop else None
        self.do_rescale = bool(s.get("do_rescale", True))
        self.rescale_factor = float(s.get("rescale_factor", 1 / 255))
        self.do_normalize = bool(s.get("do_normalize", True))
        if self.do_normalize:
            self.mean = _triple(s.get("image_mean"), "image_mean")
            self.std = _triple(s.get("image_std"), "image_std")
            if not np.all(self.std != 0):
                raise ValueError(f"image_std must not contain 0, got {s.get('image_std')!r}")
        self.height, self.width = self._output_size()
        declared = (s.get("height"), s.get("width"))
        if declared != (None, None) and declared != (self.height, self.width):
            raise ValueError(f"settings declare output {declared[0]}x{declared[1]} but the steps give "
                             f"{self.height}x{self.width}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """The output shape (3, H, W), the same for every image; (3, -1, -1) where it follows the image's (DETR)."""
        return (3, self.height, self.width)

    def _output_size(self) -> tuple[int, int]:
        if self.do_center_crop:
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize and "longest_edge" in self.size:
            return -1, -1
        if self.do_resize and "height" in self.size:
            return self.size["height"], self.size["width"]
        if self.do_resize and self.crop_pct is not None:
            edge = self.size["shortest_edge"]
            return edge, edge  # both ConvNeXt branches end square
        raise ValueError("the output size would depend on the input image (no fixed resize and no center crop); "
                         "a served model needs a fixed [3, H, W]")

    def __call__(self, data: bytes) -> np.ndarray:
        """Decode `data` (PNG or JPEG bytes) and return its pixel values, float32 [3, H, W].

        Raises:
            ValueError: the bytes are not an acceptable image (see `decode`).
        """
        return self.pixels(decode(data, self.max_pixels))

    def pixels(self, image: Image.Image) -> np.ndarray:
        """Pixel values of an RGB PIL image (already decoded as `decode` does).

        Raises:
            ValueError: the resize would exceed `max_pixels` (extreme aspect ratio with a shortest-edge resize).
        """
        if self.letterbox is not None:
            return letterbox(np.asarray(image), self.letterbox["imgsz"], self.letterbox["stride"])
        if self.do_convert_rgb and ("A" in image.getbands() or image.info.get("transparency") is not None):
            # transformers' convert_to_rgb: transparency (here, a colour key Pillow kept) onto white
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, rgba).convert("RGB")
        array = None
        if self.do_resize:
            if "height" in self.size:
                image = self._resize(image, self.size["height"], self.size["width"])
            elif "longest_edge" in self.size and self.size_multiple:
                height, width = size_with_aspect_ratio_multiple(image.height, image.width, self.size["shortest_edge"],
                                                                self.size["longest_edge"], self.size_multiple)
                if not height or not width:  # transformers' processor fails on it too
                    raise ResizedAway(f"image is {image.width}x{image.height}: resized to multiples of "
                                      f"{self.size_multiple} pixels it keeps none on its short side (aspect ratio too "
                                      "extreme for this model)")
                image = self._resize(image, height, width)
            elif "longest_edge" in self.size:
                image = self._resize(image, *size_with_aspect_ratio(image.height, image.width, self.size["shortest_edge"],
                                                                    self.size["longest_edge"]))
            elif self.crop_pct is None:
                image = self._resize(image, *shortest_edge_size(image.height, image.width,
                                                                self.size["shortest_edge"]))
            else:
                edge = self.size["shortest_edge"]
                if edge < _CONVNEXT_WARP_FROM:
                    image = self._resize(image, *shortest_edge_size(image.height, image.width,
                                                                    int(edge / self.crop_pct)))
                    array = center_crop(np.asarray(image), edge, edge)
                else:
                    image = self._resize(image, edge, edge)
        if self.max_side is not None and max(image.size) > self.max_side:
            # DETR's rule leaves a sliver whose short side is already the target uncut: its long side may pass
            # longest_edge (up to twice it)
            raise ResizedAway(f"image resized to {image.width}x{image.height}: over {self.max_side} pixels on a side, "
                              "the most this model's TensorRT plan takes (aspect ratio too extreme for it)")
        if array is None:
            array = np.asarray(image)
        if self.do_center_crop:
            array = center_crop(array, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            # transformers upcasts to float64 before scaling, then casts to float32.
            array = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            array = (array.astype(np.float32, copy=False) - self.mean) / self.std
        return np.ascontiguousarray(array.astype(np.float32, copy=False).transpose(2, 0, 1))

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        # A shortest-edge resize of a sliver (1 x 50000) would allocate gigabytes: same limit as decoding.
        if height * width > self.max_pixels:
            raise ValueError(f"image is {image.width}x{image.height}: resizing it to {width}x{height} would need "
                             f"{height * width} pixels, over the limit of {self.max_pixels} (aspect ratio too extreme)")
        return image.resize((width, height), resample=self.resample)
