"""Wire models of POST /v1/detect."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from core.contract import MAX_DETECTIONS

from ..inputs.images import ImageInput
from ..inputs.wire import SafeInt


class DetectRequest(BaseModel):
    """Images for an object-detection model; each answer's boxes are in that image's own pixels (as decoded and
    turned upright by its EXIF orientation)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr = Field(min_length=1, max_length=256)
    input: Annotated[list[ImageInput], Field(min_length=1)] = Field(
        description='images as [{"image": "<base64 PNG/JPEG, or a data URL>"}, ...]')
    conf: float | None = Field(None, ge=0, le=1, description="keep detections scoring over this (default: the model's)")
    iou: float | None = Field(None, ge=0, le=1, description="NMS overlap threshold, for detectors that use NMS "
                              "(DETR-family models predict a set and take none)")
    max_det: SafeInt | None = Field(None, ge=1, le=MAX_DETECTIONS, description="most detections per image, best first")
    classes: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(
        None, min_length=1, description="keep only these class ids")
    user: StrictStr | None = Field(None, max_length=256)


class Detection(BaseModel):
    box: list[float] = Field(description="[x1, y1, x2, y2] in the image's pixels")
    score: float
    class_id: int
    label: str


class ImageDetections(BaseModel):
    index: int
    width: int
    height: int
    detections: list[Detection]


class DetectResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[ImageDetections]
