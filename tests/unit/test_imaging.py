"""Image pre-processing of image-classification exports: the Triton-side `imaging` module against
transformers' PIL image processors (what `pipeline("image-classification")` feeds the model)."""

import importlib.util
import io
import json
import struct
import sys
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import (
    BeitImageProcessorPil,
    BitImageProcessorPil,
    ConvNextImageProcessorPil,
    DeiTImageProcessorPil,
    ViTImageProcessorPil,
)
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PILImageResampling

from export.exceptions import ExportError
from export.triton.python_models.image_preprocess.imaging import Preprocess, decode
from export.vision import SUPPORTED_PROCESSORS, read_image_processor, reference_pixels, sample_images

REPO = Path(__file__).resolve().parents[2]
IMAGING_DIR = REPO / "export" / "triton" / "python_models" / "image_preprocess"
# transformers' PIL processors resize the uint8 PIL image, rescale in float64 -> float32 and normalise in
# float32; imaging.py does the same operations in the same order, so the match is exact (0.0). The
# tolerance only leaves room for a platform whose float32 division differs in the last bit.
ATOL = 1e-5

PROCESSORS = {
    "vit": lambda: ViTImageProcessorPil(size={"height": 224, "width": 224}, resample=PILImageResampling.BILINEAR,
                                        image_mean=[0.5] * 3, image_std=[0.5] * 3),
    "convnext-224": lambda: ConvNextImageProcessorPil(size={"shortest_edge": 224}, crop_pct=0.875,
                                                      resample=PILImageResampling.BICUBIC,
                                                      image_mean=IMAGENET_DEFAULT_MEAN, image_std=IMAGENET_DEFAULT_STD),
    "convnext-384": lambda: ConvNextImageProcessorPil(size={"shortest_edge": 384}, crop_pct=0.875,
                                                      resample=PILImageResampling.BICUBIC,
                                                      image_mean=IMAGENET_DEFAULT_MEAN, image_std=IMAGENET_DEFAULT_STD),
    # microsoft/resnet-50 ships a ConvNeXt processor: shortest edge 224, crop_pct 0.875, bicubic, ImageNet stats
    "resnet-50": lambda: ConvNextImageProcessorPil(size={"shortest_edge": 224}, crop_pct=0.875, resample=3,
                                                   image_mean=IMAGENET_DEFAULT_MEAN, image_std=IMAGENET_DEFAULT_STD),
    "deit": lambda: DeiTImageProcessorPil(size={"height": 256, "width": 256}, crop_size={"height": 224, "width": 224},
                                          do_center_crop=True, resample=PILImageResampling.BICUBIC),
    "beit": lambda: BeitImageProcessorPil(),
    # shortest-edge resize + center crop, and do_convert_rgb (colour-keyed transparency onto white)
    "bit": lambda: BitImageProcessorPil(),
    # a crop larger than the resized image: transformers pads with zeros
    "vit-crop-pads": lambda: ViTImageProcessorPil(size={"height": 200, "width": 180}, do_center_crop=True,
                                                  crop_size={"height": 224, "width": 224}),
}
# The legacy feature-extractor spelling older hub checkpoints carry (an int size, no image_processor_type).
LEGACY_RESNET = {"crop_pct": 0.875, "do_normalize": True, "do_resize": True,
                 "feature_extractor_type": "ConvNextFeatureExtractor", "image_mean": IMAGENET_DEFAULT_MEAN,
                 "image_std": IMAGENET_DEFAULT_STD, "resample": 3, "size": 224}


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return sample_images()


def _checkpoint(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    PROCESSORS[name]().save_pretrained(folder)
    return folder


def _write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return folder


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_pixels_match_transformers_image_processor_on_every_sample(tmp_path, images, name):
    folder = _checkpoint(tmp_path, name)
    settings = read_image_processor(folder)
    json.dumps(settings)  # goes into config.pbtxt as a string parameter
    preprocess = Preprocess(settings)
    got = np.stack([preprocess(data) for data in images])
    want = np.stack(reference_pixels(folder, images))
    assert got.dtype == np.float32 and got.shape[1:] == preprocess.shape
    assert _max_diff(got, want) <= ATOL


def test_legacy_feature_extractor_config_reads_as_convnext(tmp_path, images):
    folder = _write_config(tmp_path / "resnet", LEGACY_RESNET)
    settings = read_image_processor(folder)
    assert settings["image_processor_type"] == "ConvNextImageProcessor"
    assert settings["size"] == {"shortest_edge": 224} and settings["crop_pct"] == 0.875
    got = np.stack([Preprocess(settings)(data) for data in images])
    assert _max_diff(got, np.stack(reference_pixels(folder, images))) <= ATOL


def test_settings_are_the_processors_values_in_plain_json(tmp_path):
    settings = read_image_processor(_checkpoint(tmp_path, "convnext-224"))
    assert settings == {
        "image_processor_type": "ConvNextImageProcessor", "do_convert_rgb": False, "do_resize": True,
        "size": {"shortest_edge": 224}, "crop_pct": 0.875, "resample": 3, "do_center_crop": False,
        "crop_size": None, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": IMAGENET_DEFAULT_MEAN, "image_std": IMAGENET_DEFAULT_STD, "height": 224, "width": 224,
    }
    deit = read_image_processor(_checkpoint(tmp_path, "deit"))
    assert (deit["size"], deit["crop_size"], Preprocess(deit).shape) == (
        {"height": 256, "width": 256}, {"height": 224, "width": 224}, (3, 224, 224))
    assert Preprocess(read_image_processor(_checkpoint(tmp_path, "convnext-384"))).shape == (3, 384, 384)


def test_decode_applies_exif_orientation_and_drops_alpha_like_load_image(images):
    exif_rotated = decode(images[2])  # stored 400x240 with Orientation 6
    assert exif_rotated.size == (240, 400) and exif_rotated.mode == "RGB"
    rgba = Image.open(io.BytesIO(images[4]))
    assert rgba.mode == "RGBA"
    assert np.array_equal(np.asarray(decode(images[4])), np.asarray(rgba.convert("RGB")))


# --- bad images ---------------------------------------------------------------------------------------


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height (a decompression bomb's header) with no pixel data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) \
        + chunk(b"IEND", b"")


def _encoded(fmt: str, size=(32, 24)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vit() -> Preprocess:
    return Preprocess({"size": {"height": 224, "width": 224}, "resample": 2, "image_mean": [0.5] * 3,
                       "image_std": [0.5] * 3})


@pytest.mark.parametrize("data, message", [
    (b"this is not an image at all", r"image is not PNG or JPEG \(got unrecognised data starting 7468697320697320\)"),
    (b"", r"image is not PNG or JPEG \(got empty input\)"),
    (_encoded("GIF"), r"image is not PNG or JPEG \(got GIF\)"),
    (_encoded("BMP"), r"image is not PNG or JPEG \(got BMP\)"),
    (_encoded("WEBP"), r"image is not PNG or JPEG \(got WEBP\)"),
])
def test_other_formats_and_garbage_are_rejected_by_name(vit, data, message):
    with pytest.raises(ValueError, match=message):
        vit(data)


def test_truncated_png_and_jpeg_are_rejected(vit, images):
    png, jpeg = images[0], images[1]
    with pytest.raises(ValueError, match=r"cannot (read|decode) PNG image"):
        vit(png[: len(png) // 2])
    with pytest.raises(ValueError, match=r"cannot (read|decode) JPEG image"):
        vit(jpeg[: len(jpeg) // 2])
    with pytest.raises(ValueError, match=r"cannot (read|decode) PNG image"):
        vit(png[:40])  # cut inside the header chunk


def test_images_over_the_pixel_limit_are_refused_from_the_header(vit):
    with pytest.raises(ValueError, match=r"8000x7000 = 56000000 pixels, over the limit of 50000000"):
        vit(_png_header_only(8000, 7000))
    with pytest.raises(ValueError, match=r"too large|over the limit"):  # past Pillow's own bomb limit too
        vit(_png_header_only(60000, 60000))
    small_limit = Preprocess({**_vit_settings(), "max_pixels": 100})
    with pytest.raises(ValueError, match=r"32x24 = 768 pixels, over the limit of 100"):
        small_limit(_encoded("PNG"))


def test_slivers_whose_shortest_edge_resize_would_explode_are_refused(tmp_path):
    convnext = Preprocess(read_image_processor(_checkpoint(tmp_path, "convnext-224")))
    with pytest.raises(ValueError, match=r"1x2000: resizing it to 256x512000 would need 131072000 pixels"):
        convnext(_encoded("PNG", size=(1, 2000)))


def _vit_settings() -> dict:
    return {"size": {"height": 224, "width": 224}, "resample": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


@pytest.mark.parametrize("change, message", [
    ({"sise": 1}, r"unknown image settings \['sise'\]"),
    ({"size": {"shortest_edge": 224}}, r"output size would depend on the input image"),
    ({"size": {"height": 0, "width": 3}}, r"size.height must be a positive integer"),
    ({"resample": 9}, r"resample must be a PIL filter code"),
    ({"image_mean": [0.5, 0.5]}, r"image_mean must be a list of 3 numbers"),
    ({"height": 200, "width": 224}, r"settings declare output 200x224 but the steps give 224x224"),
])
def test_bad_settings_fail_at_construction(change, message):
    with pytest.raises(ValueError, match=message):
        Preprocess({**_vit_settings(), **change})


def test_missing_preprocessor_config_is_an_export_error(tmp_path):
    with pytest.raises(ExportError, match=r"^image-classification needs preprocessor_config.json beside the model; "
                                          r"save it with image_processor.save_pretrained$"):
        read_image_processor(tmp_path)


@pytest.mark.parametrize("kind", ["CLIPImageProcessor", "DetrImageProcessorFast", "MobileViTFeatureExtractor"])
def test_unsupported_processor_type_lists_the_supported_ones(tmp_path, kind):
    folder = _write_config(tmp_path / "ckpt", {"image_processor_type": kind, "size": {"height": 224, "width": 224}})
    with pytest.raises(ExportError, match=rf"{kind}.*not supported.*supported: {', '.join(SUPPORTED_PROCESSORS)}"):
        read_image_processor(folder)


def test_variable_output_size_is_an_export_error(tmp_path):
    folder = tmp_path / "vit-shortest"
    ViTImageProcessorPil(size={"shortest_edge": 224}).save_pretrained(folder)
    with pytest.raises(ExportError, match=r"ViTImageProcessor.*fixed \[3, H, W\]"):
        read_image_processor(folder)


# --- the Triton side ----------------------------------------------------------------------------------


class _FakeTritonError:
    INTERNAL, INVALID_ARG = "INTERNAL", "INVALID_ARG"

    def __init__(self, message, code="INTERNAL"):
        self.text, self.code = message, code

    def message(self):
        return self.text


class _FakeTensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class _FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self.output_tensors, self.error = list(output_tensors), error


def _load_triton_model(monkeypatch):
    fake = types.ModuleType("triton_python_backend_utils")
    fake.TritonError, fake.Tensor, fake.InferenceResponse = _FakeTritonError, _FakeTensor, _FakeResponse
    fake.TritonModelException = type("TritonModelException", (Exception,), {})
    fake.get_input_tensor_by_name = lambda request, name: request[name]
    fake.Logger = types.SimpleNamespace(log_error=lambda message: None)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # initialize() sets Pillow's limit
    spec = importlib.util.spec_from_file_location("image_preprocess_model", IMAGING_DIR / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, fake


def _model_config(settings: dict, dims=(3, 224, 224)) -> dict:
    return {"model_config": json.dumps({
        "input": [{"name": "IMAGE", "data_type": "TYPE_STRING", "dims": ["1"]}],
        "output": [{"name": "pixel_values", "data_type": "TYPE_FP32", "dims": [str(d) for d in dims]}],
        "parameters": {"image_processor": {"string_value": json.dumps(settings)}},
    })}


def test_triton_model_fails_only_the_request_with_a_bad_image(monkeypatch, images):
    module, fake = _load_triton_model(monkeypatch)
    model = module.TritonPythonModel()
    model.initialize(_model_config(_vit_settings()))
    good = {"IMAGE": _FakeTensor("IMAGE", np.array([[images[0]], [images[5]]], dtype=object))}
    bad = {"IMAGE": _FakeTensor("IMAGE", np.array([[_encoded("GIF")]], dtype=object))}
    first, second, third = model.execute([good, bad, good])
    pixels = first.output_tensors[0]
    assert first.error is None and pixels.name == "pixel_values" and pixels.array.shape == (2, 3, 224, 224)
    assert np.array_equal(pixels.array[1], Preprocess(_vit_settings())(images[5]))
    assert second.output_tensors == [] and second.error.code == fake.TritonError.INVALID_ARG
    assert "image is not PNG or JPEG (got GIF)" in second.error.message()
    assert third.error is None


def test_triton_model_checks_its_config_at_load(monkeypatch):
    module, fake = _load_triton_model(monkeypatch)
    with pytest.raises(fake.TritonModelException, match=r"outputs must be pixel_values \[3, 224, 224\]"):
        module.TritonPythonModel().initialize(_model_config(_vit_settings(), dims=(3, 256, 256)))
    with pytest.raises(fake.TritonModelException, match=r"bad 'image_processor' parameter"):
        module.TritonPythonModel().initialize(_model_config({**_vit_settings(), "resample": 42}))
