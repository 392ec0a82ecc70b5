"""Runs inside the Ultralytics environment (`.envs/ultralytics`, `make setup-ultralytics`), never imported by
rtxserve: Ultralytics is AGPL-3.0 and needs a torchvision that does not load beside rtxserve's CPU torch, so
export/detection/yolo.py starts this file with that environment's Python (`python -P`, so that export/'s own
modules do not shadow installed ones; export/tool_env.py's run_tool) and reads back what it writes. yolo.py's
run_in_ultralytics starts it for the YOLO test fixture (fixture_models/detection.py) and benchmark B7
(bench/detection.py) too.

    python -P ultralytics_runner.py export REQUEST.json
    python -P ultralytics_runner.py train REQUEST.json     (the test fixture: `rtxserve fixtures yolo`)
    python -P ultralytics_runner.py build|time|val REQUEST.json   (benchmark B7: `rtxserve bench detection`)

REQUEST.json: {"checkpoint": best.pt, "work": a folder to write into, "images": [.npy files of upright RGB uint8
images, decoded by rtxserve], "conf", "iou", "max_det": the predict settings the reference answers use}.

It writes into `work`:
  model.onnx       Ultralytics' own ONNX export of the checkpoint (dynamic batch, height and width; no NMS)
  reference.npz    per image i: input_i (the tensor Ultralytics' predictor feeds the model) and output_i (what the
                   PyTorch model answers to it): the graph's parity against PyTorch
  result.json      {"names", "imgsz", "stride", "task", "args", "versions", "predictions": per image
                   [[x1, y1, x2, y2, score, class id], ...] from `model.predict`, best first, "also": the same for
                   each of the request's "also" (other predict settings: [{"iou": 0.95}, ...]), if any}
An error the user can act on is written as {"error": "..."} to result.json, with exit status 3.

`build` ({"yaml": e.g. yolo11s.yaml, "out": a .pt}) saves a model of that shape with random weights; `time`
({"weights", "input": an .npy tensor, "iterations", "threads", "work"}) writes the median milliseconds of the PyTorch
model's forward on it, as Ultralytics' predictor runs it, to work/result.json; `val` ({"models": [.pt or .onnx],
"data": a dataset yaml, "imgsz", "work"}) writes each model's box mAP@0.5 and mAP@0.5:0.95 from Ultralytics' own
validator (ONNX graphs run by its ONNX Runtime backend).

`train` (REQUEST.json: {"out": a folder, "imgsz", "epochs", "images", "val_images", "seed"}) writes a dataset of
coloured rectangles on grey (classes red and blue, YOLO labels) under out/data and trains a YOLO11n from its YAML
(random weights drawn with `seed`; nothing is downloaded) on it into out/run: weights/best.pt and args.yaml, as `yolo
train` writes them; out/result.json: {"predictions": per validation image by name, the rows of `model.predict` at conf
0.01}, which the fixture's build checks (rtxserve's fixture_models/detection.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

SUPPORTED_TASK = "detect"
EXIT_REFUSED = 3


def _refuse(work: Path, message: str) -> None:
    (work / "result.json").write_text(json.dumps({"error": message}))
    sys.exit(EXIT_REFUSED)


def _offline(folder: Path) -> None:
    """Offline, nothing installed behind our back, settings and fonts in our own folder, not the user's home."""
    os.environ.update(YOLO_OFFLINE="1", YOLO_AUTOINSTALL="false", YOLO_VERBOSE="false",
                      YOLO_CONFIG_DIR=str(folder / "ultralytics-config"))


CLASSES = {0: ("red", (220, 40, 40)), 1: ("blue", (40, 40, 220))}


def train(request: dict) -> None:
    out = Path(request["out"])
    _offline(out)
    import numpy as np
    from PIL import Image, ImageDraw
    from ultralytics import YOLO

    rng, size = np.random.default_rng(0), request["imgsz"]
    for split, count in (("train", request["images"]), ("val", request.get("val_images", request["images"]))):
        (out / "data" / "images" / split).mkdir(parents=True, exist_ok=True)
        (out / "data" / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image, lines = Image.new("RGB", (size, size), (90, 90, 90)), []
            draw = ImageDraw.Draw(image)
            for _ in range(2):
                c = int(rng.integers(0, len(CLASSES)))
                w, h = (int(v) for v in rng.integers(size // 5, size // 2, 2))
                x, y = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
                draw.rectangle([x, y, x + w - 1, y + h - 1], fill=CLASSES[c][1])
                lines.append(f"{c} {(x + w / 2) / size:.6f} {(y + h / 2) / size:.6f} {w / size:.6f} {h / size:.6f}")
            image.save(out / "data" / "images" / split / f"{i}.png")
            (out / "data" / "labels" / split / f"{i}.txt").write_text("\n".join(lines) + "\n")
    names = "".join(f"  {k}: {v[0]}\n" for k, v in CLASSES.items())
    (out / "data.yaml").write_text(f"path: {out / 'data'}\ntrain: images/train\nval: images/val\nnames:\n{names}")
    # No augmentation and a steady learning rate: a few seconds of CPU that leave a model finding the rectangles.
    # save=False writes last.pt / best.pt at the final epoch only, not at each of the 300: the same weights (the
    # final epoch's EMA either way, as val=False scores no earlier one), in 42 s instead of 97 s here.
    YOLO("yolo11n.yaml").train(
        data=str(out / "data.yaml"), epochs=request["epochs"], imgsz=size, batch=request["images"], workers=0,
        device="cpu", project=str(out), name="run", exist_ok=True, plots=False, amp=False, val=False, save=False, verbose=False,
        seed=request.get("seed", 0), deterministic=True, optimizer="AdamW", lr0=0.003, warmup_epochs=0, mosaic=0.0, hsv_h=0.0, hsv_s=0.0,
        hsv_v=0.0, fliplr=0.0, scale=0.0, translate=0.0)
    model = YOLO(str(out / "run" / "weights" / "best.pt"))
    val = sorted((out / "data" / "images" / "val").glob("*.png"))  # by name, as rtxserve's validation_images
    predictions = [_rows(r) for r in model.predict([str(p) for p in val], conf=0.01, device="cpu", verbose=False)]
    (out / "result.json").write_text(json.dumps({"predictions": predictions}))


def _rows(result) -> list[list[float]]:
    """One image's predictions as rows of x1, y1, x2, y2, score, class id, best first."""
    import torch

    boxes = result.boxes
    return (torch.cat([boxes.xyxy, boxes.conf[:, None], boxes.cls[:, None]], dim=1) if len(boxes)
            else torch.zeros(0, 6)).tolist()


def build(request: dict) -> None:
    out = Path(request["out"])
    _offline(out.parent)
    from ultralytics import YOLO

    YOLO(request["yaml"]).save(str(out))


def time_forward(request: dict) -> None:
    work = Path(request["work"])
    _offline(work)
    import statistics
    import time

    import numpy as np
    import torch
    from ultralytics import YOLO

    torch.set_num_threads(request["threads"])
    model = YOLO(request["weights"])
    tensor = torch.from_numpy(np.load(request["input"]))
    model.predict(np.zeros((64, 64, 3), np.uint8), device="cpu", verbose=False)  # builds the predictor's fused model
    forward, times = model.predictor.model, []
    with torch.no_grad():
        for i in range(request["iterations"] + 3):  # three warm-up calls
            started = time.perf_counter()
            forward(tensor)
            if i >= 3:
                times.append((time.perf_counter() - started) * 1000)
    (work / "result.json").write_text(json.dumps({"median_ms": statistics.median(times), "torch": torch.__version__}))


def val(request: dict) -> None:
    work = Path(request["work"])
    _offline(work)
    from ultralytics import YOLO

    found = {}
    for path in request["models"]:
        metrics = YOLO(path, task="detect").val(data=request["data"], imgsz=request["imgsz"], batch=1, device="cpu",
                                                plots=False, verbose=False, project=str(work), name="val",
                                                exist_ok=True, workers=0)
        found[path] = {"map50": float(metrics.box.map50), "map50_95": float(metrics.box.map)}
    (work / "result.json").write_text(json.dumps(found))


def export(request: dict) -> None:
    work = Path(request["work"])
    _offline(work)
    import numpy as np
    import torch
    import ultralytics
    from ultralytics import YOLO

    # Exported from a copy: Ultralytics writes the .onnx beside the weights, and the user's run folder stays as it was.
    weights = work / "weights.pt"
    shutil.copyfile(request["checkpoint"], weights)
    try:
        model = YOLO(str(weights))
    except Exception as exc:  # a file that is not a checkpoint, or one of a newer Ultralytics
        _refuse(work, f"Ultralytics cannot load {request['checkpoint']}: {type(exc).__name__}: {exc}")
    if model.task != SUPPORTED_TASK:
        _refuse(work, f"{request['checkpoint']} is an Ultralytics {model.task} model; rtxserve serves detect models "
                      f"(not yet {model.task})")
    imgsz = model.overrides.get("imgsz", 640)
    imgsz = int(imgsz if isinstance(imgsz, int) else max(imgsz))
    stride = int(max(model.model.stride))

    onnx_path = model.export(format="onnx", imgsz=imgsz, dynamic=True, simplify=True, nms=False, device="cpu",
                             half=False, verbose=False)
    shutil.move(onnx_path, work / "model.onnx")

    settings = {k: request[k] for k in ("conf", "iou", "max_det")}
    train_args = model.ckpt.get("train_args", {})
    graph_nms = None
    if request.get("nms"):
        # NMS in the graph, as Ultralytics' nms=True: its iou and max_det are the run's (else predict's defaults), fixed
        # in the graph; its conf is a floor under which nothing leaves the graph. `batch`: the most images a call
        # holds (Ultralytics unrolls its NMS loop to it). The predictions below use the same iou and max_det.
        graph_nms = {"conf": request["conf"], "iou": float(train_args.get("iou") or request["iou"]),
                     "max_det": int(train_args.get("max_det") or request["max_det"])}
        settings |= {"iou": graph_nms["iou"], "max_det": graph_nms["max_det"]}
        onnx_path = model.export(format="onnx", imgsz=imgsz, dynamic=True, simplify=True, nms=True,
                                 batch=int(request.get("batch") or 1), device="cpu", half=False, verbose=False,
                                 **graph_nms)
        shutil.move(onnx_path, work / "model_nms.onnx")
    predictions, tensors, also = [], {}, [[] for _ in request.get("also", [])]
    for i, path in enumerate(request["images"]):
        bgr = np.ascontiguousarray(np.load(path)[..., ::-1])  # Ultralytics takes arrays as OpenCV's BGR
        for found, other in zip(also, request.get("also", [])):
            found.append(_rows(model.predict(bgr, device="cpu", verbose=False, **(settings | other))[0]))
        predictions.append(_rows(model.predict(bgr, device="cpu", verbose=False, **settings)[0]))
        predictor = model.predictor
        tensor = predictor.preprocess([bgr])
        with torch.no_grad():
            raw = predictor.model(tensor)
        raw = raw[0] if isinstance(raw, (list, tuple)) else raw
        tensors[f"input_{i}"], tensors[f"output_{i}"] = tensor.numpy(), raw.numpy()
    np.savez(work / "reference.npz", **tensors)

    args = {k: v for k, v in train_args.items() if isinstance(v, (str, int, float, bool))}
    import onnx
    import onnxruntime

    (work / "result.json").write_text(json.dumps({
        "names": {int(k): str(v) for k, v in model.names.items()}, "imgsz": imgsz, "stride": stride,
        "task": model.task, "args": args, "predictions": predictions, "also": also, "graph_nms": graph_nms,
        "versions": {"ultralytics": ultralytics.__version__, "torch": torch.__version__, "onnx": onnx.__version__,
                     "onnxruntime": onnxruntime.__version__}}))


if __name__ == "__main__":
    commands = {"export": export, "train": train, "build": build, "time": time_forward, "val": val}
    commands[sys.argv[1]](json.loads(Path(sys.argv[2]).read_text()))
