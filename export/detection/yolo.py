"""Export an Ultralytics YOLO detector (`best.pt` / `last.pt` of `yolo train`, or its run folder) to a Triton entry.

Ultralytics itself does the ONNX export and the reference answers, in its own environment (`.envs/ultralytics`,
`make setup-ultralytics`: it is AGPL-3.0 and needs a torchvision that does not load beside our CPU torch), through
`ultralytics_runner.py`. Here: the graph checked against the PyTorch model's outputs (atol; min cosine for int8 /
fp16 variants), the served steps (`imaging.letterbox`, the graph in ONNX Runtime, `detections.yolo_detections`)
checked against Ultralytics' own `model.predict` on the sample images, and the entry written as for DETR
(export/triton/entry.py: detection_entry). With --tensorrt (a GPU machine) the fp32 graph becomes a TensorRT plan
(export/tensorrt/plan.py) whose sides range from one stride to imgsz, as the letterbox makes them, checked the same
way and served as the entry's tensorrt_plan step. Nothing of Ultralytics is imported by rtxserve.
"""

from __future__ import annotations

import base64
import logging
import re
import tempfile
from pathlib import Path

import numpy as np

from core.envs import ULTRALYTICS
from core.reference import FILE as REFERENCE_FILE, Item, ReferenceError
from core.tasks import OBJECT_DETECTION

from .. import variants
from ..activations import graph_activations
from ..exceptions import ExportError
from ..parity import ParityReport
from ..progress import Steps
from ..reference import eval_items
from ..tensorrt.plan import Profile
from ..tool_env import run_tool, tool_python
from ..triton import repository
from ..triton.entry import EntryOptions, detection_entry
from ..triton.python_models.detection_postprocess.detections import yolo_detections, yolo_nms_detections
from ..triton.python_models.image_preprocess import imaging
from .served import compare_detections, gate_served

log = logging.getLogger(__name__)

RUNNER = Path(__file__).with_name("ultralytics_runner.py")
# Ultralytics' predict defaults; a checkpoint's args.yaml overrides them where it sets them.
PREDICT_DEFAULTS = {"conf": 0.25, "iou": 0.7, "max_det": 300}
# The served answers are checked at a threshold low enough that a briefly trained model finds something.
PARITY_CONF = 0.01
RUNNER_TIMEOUT_S = 1800
# Parity images taken from the run's validation set by default (the first ones by name).
VALIDATION_SAMPLES = 16
PLAN_INPUT = (3, -1, -1)  # a TensorRT plan's images: height and width follow the letterbox (plan_profile)


def ultralytics_checkpoint(path: Path) -> Path | None:
    """The weights of an Ultralytics run: `path` itself (a .pt file), or a run folder's weights/best.pt (else
    last.pt); None for anything else (a Hugging Face folder)."""
    if path.is_file() and path.suffix == ".pt":
        return path
    if path.is_dir() and (path / "args.yaml").is_file():
        for name in ("best.pt", "last.pt"):
            if (path / "weights" / name).is_file():
                return path / "weights" / name
        raise ExportError(f"{path} is an Ultralytics run folder (args.yaml) without weights/best.pt or weights/last.pt")
    return None


def recorded_task(weights: Path) -> str | None:
    """The task the run's args.yaml records (detect, segment, pose, obb, classify), or None without one."""
    run = weights.parent.parent if weights.parent.name == "weights" else weights.parent
    args = run / "args.yaml"
    found = re.search(r"^task:\s*(\S+)", args.read_text(errors="replace"), flags=re.M) if args.is_file() else None
    return found.group(1) if found else None


def validation_images(weights: Path, limit: int = VALIDATION_SAMPLES) -> list[Path]:
    """The first `limit` images (by name) of the validation set the run trained against, where its args.yaml names
    a dataset YAML on this machine whose `val` is a folder ([] otherwise): the images a fine-tune is meant for."""
    import yaml

    run = weights.parent.parent if weights.parent.name == "weights" else weights.parent
    try:
        data = Path(yaml.safe_load((run / "args.yaml").read_text())["data"])
        dataset = yaml.safe_load(data.read_text())
        root = Path(dataset.get("path") or data.parent)
        val = dataset["val"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return []
    if not isinstance(val, str):
        return []
    # a relative `path` is Ultralytics' from the working directory (else its datasets_dir setting); or beside the YAML
    folders = [root / val] if root.is_absolute() else [root / val, data.parent / root / val]
    folder = next((f for f in folders if f.is_dir()), None)
    if folder is None:
        return []
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in {".png", ".jpg", ".jpeg"})[:limit]


def check_task(weights: Path, task: str) -> None:
    """Refuse, before any work, a run of another task than detect, or a YOLO named for another rtxserve task."""
    if task != OBJECT_DETECTION:
        raise ExportError(f"{weights} is an Ultralytics checkpoint: export it with --task {OBJECT_DETECTION} "
                          f"(not {task})")
    recorded = recorded_task(weights)
    if recorded not in (None, "detect"):
        raise ExportError(f"{weights} is an Ultralytics {recorded} model (its args.yaml says task: {recorded}); "
                          "rtxserve serves detect models, not yet " + recorded)


def _run(command: str, request: dict, scratch: Path, what: str) -> dict | None:
    python = tool_python(ULTRALYTICS, "setup-ultralytics", "Ultralytics")
    return run_tool(python, RUNNER, command, request, scratch, what, RUNNER_TIMEOUT_S)


def run_in_ultralytics(command: str, request: dict, scratch: Path):
    """One of ultralytics_runner.py's other commands (build, time, val): its result.json, where it writes one."""
    scratch.mkdir(parents=True, exist_ok=True)
    return _run(command, {**request, "work": str(scratch)}, scratch, f"Ultralytics' {command}")


def run_ultralytics(weights: Path, images: list[np.ndarray], settings: dict, scratch: Path) -> dict:
    """Ultralytics' export and predictions in its own environment (ultralytics_runner.py): result.json's contents,
    with model.onnx and reference.npz beside it in `scratch`."""
    paths = []
    for i, image in enumerate(images):
        paths.append(str(scratch / f"image_{i}.npy"))
        np.save(paths[-1], image)
    return _run("export", {"checkpoint": str(weights.resolve()), "work": str(scratch), "images": paths, **settings},
                scratch, f"Ultralytics' export of {weights}")


def _refuse_end_to_end(onnx_path: Path, weights: Path) -> None:
    """An NMS-free model (YOLO26, YOLOv10) exports output0 [batch, 300, 6], rows of boxes already chosen: not served
    yet, and said so rather than written as an entry that would misread them."""
    import onnx

    dims = [d.dim_value or d.dim_param for d in onnx.load(str(onnx_path), load_external_data=False)
            .graph.output[0].type.tensor_type.shape.dim]
    if len(dims) == 3 and isinstance(dims[2], int) and dims[2] == 6 and isinstance(dims[1], int):
        raise ExportError(f"{weights} is an end-to-end (NMS-free) model, YOLO26 or YOLOv10 (its graph answers {dims[1]} "
                          "chosen boxes per image); rtxserve serves YOLO detectors with NMS (YOLOv8, YOLO11) today, "
                          "end-to-end ones not yet")


def _forward(path: Path):
    """images [batch, 3, H, W] -> output0, by the served model at `path` (a graph in ONNX Runtime, or a plan)."""
    from ..tensorrt.runtime import session

    run = session(path).run
    return lambda pixels: run(["output0"], {"images": pixels})[0]


def _graph_parity(path: Path, reference: dict, imgsz: int, atol: float, min_cosine: float | None,
                  allow_drift: bool) -> dict:
    """The graph's (or plan's) output0 against the PyTorch model's on the tensors Ultralytics' predictor made: its
    boxes (in pixels, compared as fractions of imgsz, so that one atol means the same as for scores) and its scores."""
    forward = _forward(path)
    report = ParityReport(atol=atol, min_cosine=min_cosine)
    split = lambda out: {"boxes": out[:, :4] / imgsz, "scores": out[:, 4:]}  # noqa: E731
    for i in range(len(reference) // 2):
        got = forward(reference[f"input_{i}"])
        report.add(split(reference[f"output_{i}"]), split(got))
    report.notes.append("reference: the PyTorch model as Ultralytics' predictor runs it, on its own letterboxed "
                        f"tensors; output0 split into boxes (divided by imgsz {imgsz}) and class scores")
    report.check(allow_drift)
    return report.to_dict()


def head_convolutions(onnx_path: Path) -> list[str]:
    """The convolutions of the graph's last module, the Detect head (Ultralytics names nodes /model.<i>/...): kept
    float at int8, where the box distributions and class scores are made (a quarter of the convolutions, a small
    share of the work)."""
    import onnx

    convs = [n.name for n in onnx.load(str(onnx_path)).graph.node if n.op_type == "Conv"]
    found = [int(m.group(1)) for n in convs if (m := re.match(r"/model\.(\d+)/", n))]
    return [n for n in convs if found and n.startswith(f"/model.{max(found)}/")]


def served_detections(path: Path, images: list[np.ndarray], letterbox: dict, conf: float, iou: float,
                      max_det: int, graph_nms: bool = False) -> list[np.ndarray]:
    """What the entry's steps answer for each image: imaging.letterbox, the graph (or plan), detections.yolo_detections
    (or, with NMS in the graph, detections.yolo_nms_detections: `iou` is the graph's then)."""
    forward = _forward(path)
    found = []
    for image in images:
        pixels = imaging.letterbox(image, letterbox["imgsz"], letterbox["stride"])
        output = forward(pixels[None])[0]
        height, width = image.shape[:2]
        found.append(yolo_nms_detections(output, pixels.shape[1:], height, width, conf, max_det) if graph_nms else
                     yolo_detections(output, pixels.shape[1:], height, width, conf, iou, max_det))
    return found


def export_yolo(weights: Path, entry: EntryOptions, repo: Path, options) -> tuple[list[Path], dict, float]:
    """Export the Ultralytics detector `weights` (see ultralytics_checkpoint) as the Triton entry `entry` in `repo`.

    `options` are the encoder export's (export.encoders.encoder.EncoderOptions): atol, allow_drift, force, sample_images,
    precision (fp32, int8 or fp16), min_cosine, calibration_images (int8; default: the sample images), command.
    Returns (the written model folders, the parity report, seconds). Raises ExportError on bad input, a failed
    export or a parity breach (nothing is written then).
    """
    _check_options(options, entry)
    repository.check_free(repo, entry.model_names(), options.force)
    steps = Steps(5 + (2 if options.tensorrt is not None else options.precision != "fp32"), log)
    if options.command:
        log.info("reproduce with: %s", options.command)
    items = eval_items(options.eval_set, OBJECT_DETECTION)  # the user's images, for parity and the reference set
    samples = [base64.b64decode(i.input["image"]) for i in items] if items else \
        options.sample_images or _default_samples(weights)
    images = [np.asarray(imaging.decode(data)) for data in samples]
    with tempfile.TemporaryDirectory(prefix="rtxserve-ultralytics-") as scratch, repository.work_dir(repo) as work:
        scratch = Path(scratch)
        steps("exporting %s with Ultralytics (its own environment) and its predictions on %d images", weights,
              len(images))
        # With --nms, PARITY_CONF is also the graph's conf floor: a request may ask for any conf over it.
        result = run_ultralytics(weights, images, {"conf": PARITY_CONF, "iou": PREDICT_DEFAULTS["iou"],
                                                   "max_det": PREDICT_DEFAULTS["max_det"], "nms": options.nms,
                                                   "batch": entry.max_batch_size}, scratch)
        served = work / "model.onnx"
        (scratch / "model.onnx").rename(served)
        _refuse_end_to_end(served, weights)
        graph_nms = result["graph_nms"]
        with np.load(scratch / "reference.npz") as npz:
            reference = dict(npz)
        steps("validating ONNX Runtime (fp32) against PyTorch on %d images", len(images))
        imgsz = result["imgsz"]
        reports = {"fp32": _graph_parity(served, reference, imgsz, options.atol, None, options.allow_drift)}
        letterbox = {"imgsz": imgsz, "stride": result["stride"]}
        served, variant, plan_info = _variant(served, reference, images, letterbox, entry, options, work, steps)
        reports |= variant
        # the raw graph (a plan's: the fp32 graph it was built from); NMS adds little
        activations = graph_activations(served if plan_info is None else work / "model.onnx", "images", (3, imgsz, imgsz))
        if graph_nms is not None:  # the graph checked above is the raw one; the served one has NMS in it
            served = work / "model_nms.onnx"
            (scratch / "model_nms.onnx").rename(served)
            (work / "model.onnx").unlink()
        steps("checking the served answers against Ultralytics' predict (conf %g%s)", PARITY_CONF,
              ", NMS in the graph" if graph_nms else "")
        parity = _served_parity(served, images, letterbox, result, reports, options)
        labels = [result["names"][str(i)] for i in range(len(result["names"]))]
        defaults = _defaults(result["args"], graph_nms)
        metadata = _metadata(weights, entry, options, result, parity, defaults, letterbox)
        reference_text, metadata["reference"] = _reference(weights, options.eval_set, items, samples, result, labels,
                                                           defaults["conf"], parity["variant"])
        metadata |= {"graph_activations": activations, "nms": graph_nms is not None}  # activations: `rtxserve plan`
        if plan_info is not None:
            metadata["tensorrt"] = plan_info
        steps("writing Triton entry %s (%s, %d instance(s))", entry.name, entry.target, entry.instances)
        models = detection_entry(entry, onnx_path=served, image_processor={"image_processor_type": "UltralyticsLetterBox",
                                                                         "letterbox": letterbox},
                                 pixel_shape=(3, -1, -1), labels=labels, defaults=defaults, metadata=metadata,
                                 parity=parity, letterbox=letterbox)
        next(m for m in models if "rtxserve.json" in m.files).files[REFERENCE_FILE] = reference_text
        if plan_info is not None:
            from ..tensorrt.plan import serve_plan

            serve_plan(models, entry, served, {"images": PLAN_INPUT}, parity, plan_info)
        written = repository.commit(repo, models, work, options.force)
    steps("done: %s", ", ".join(p.name for p in written))
    return written, parity, steps.seconds


def _served_parity(served: Path, images: list[np.ndarray], letterbox: dict, result: dict, reports: dict,
                   options) -> dict:
    """The entry's parity: the last variant's graph report (all of them under "variants") and the served steps'
    detections against Ultralytics' predict at PARITY_CONF, gated (a breach raises) before anything is written."""
    graph_nms = result["graph_nms"]
    settings = graph_nms or {"iou": PREDICT_DEFAULTS["iou"], "max_det": PREDICT_DEFAULTS["max_det"]}
    parity = {**list(reports.values())[-1], "variant": list(reports)[-1], "variants": reports}
    parity["served"] = {**compare_detections(
        served_detections(served, images, letterbox, PARITY_CONF, settings["iou"], settings["max_det"],
                          graph_nms=graph_nms is not None),
        [[(row[4], int(row[5]), row[:4]) for row in rows] for rows in result["predictions"]], PARITY_CONF,
        _defaults(result["args"], graph_nms)["conf"]),
        "reference": f"Ultralytics {result['versions']['ultralytics']} model.predict", "threshold": PARITY_CONF}
    gate_served(parity["served"], options.precision, options.allow_drift)
    return parity


def _reference(weights: Path, eval_set: Path | None, items: list | None, samples: list[bytes], result: dict,
               labels: list[str], conf: float, variant: str) -> tuple[str, dict]:
    """The entry's reference set (Ultralytics' own predict on the eval set's images, or the samples) and what
    rtxserve.json names it by."""
    reference = detection_reference(
        items or [Item(input={"image": base64.b64encode(data).decode()}) for data in samples], result["predictions"],
        framework=f"ultralytics {result['versions']['ultralytics']}", source=weights.resolve(),
        made_from=str(eval_set) if eval_set else "sample images", labels=labels, conf=conf, variant=variant, drift={})
    try:
        return reference.dump()
    except ReferenceError as exc:
        raise ExportError(str(exc)) from None


def detection_reference(items: list, predictions: list[list], *, framework: str, source: Path, made_from: str,
                        labels: list[str], conf: float, variant: str, drift: dict):
    """An Ultralytics detector's reference: its own predict's detections (rows x1, y1, x2, y2, score, class id, made
    at a lower conf by the export's parity run) on each image, kept over the entry's default `conf`."""
    from core.reference import ReferenceSet

    expected = [{"detections": [[*map(float, r[:5]), int(r[5])] for r in rows if r[4] >= conf]} for rows in predictions]
    return ReferenceSet(task="object-detection", framework=framework, source=str(source), made_from=made_from,
                        labels=labels, variant=variant, drift=drift, settings={"conf": conf},
                        items=[i.model_copy(update={"expect": e}) for i, e in zip(items, expected)])


def _variant(graph: Path, reference: dict, images: list[np.ndarray], letterbox: dict, entry: EntryOptions, options,
             work: Path, steps: Steps) -> tuple[Path, dict, dict | None]:
    """The served form of the fp32 `graph` at options.precision (a TensorRT plan with --tensorrt, else an ONNX Runtime
    variant), checked against PyTorch: (its path, {variant: its parity report}, the plan's figures or None). The fp32
    graph itself is served as it is: (graph, {}, None)."""
    precision, notes, plan_info = options.precision, [], None
    if options.tensorrt is not None:  # built from the fp32 graph: TensorRT lowers the precision itself
        plan_info = _build_plan(graph, work / "model.plan", images, letterbox, entry, options, steps)
        served, name, what = work / "model.plan", f"tensorrt-{precision}", f"the TensorRT {precision} plan"
        if precision == "int8":
            notes.append(f"calibrated on {plan_info['calibration_images']} images")
    elif precision == "fp32":
        return graph, {}, None
    elif precision == "int8":  # a YOLO is convolutions: static quantisation, calibrated on images
        calibration = ([np.asarray(imaging.decode(data)) for data in options.calibration_images]
                       if options.calibration_images else images)
        feeds = ({"images": imaging.letterbox(image, letterbox["imgsz"], letterbox["stride"])[None]} for image in calibration)
        served = variants.quantize_static_int8(graph, work / "model.int8.onnx", feeds, head_convolutions(graph))
        name, what = "int8", "the int8 graph"
        notes.append(f"calibrated on {len(calibration)} images")
    else:
        served, name, what = variants.to_fp16(graph, work / "model.fp16.onnx"), "fp16", "the fp16 graph"
    steps("validating %s against PyTorch", what)
    min_cosine = None if precision == "fp32" else options.min_cosine or variants.DEFAULT_MIN_COSINE[precision]
    report = _graph_parity(served, reference, letterbox["imgsz"], options.atol, min_cosine, options.allow_drift)
    report["notes"].extend(notes)
    return served, {name: report}, plan_info


def _check_options(options, entry: EntryOptions) -> None:
    """Refuse what an Ultralytics export cannot build, before any work."""
    if options.tensorrt is not None:
        if entry.target != "gpu":
            raise ExportError("--tensorrt builds a plan that runs on GPUs only: add --target gpu")
        if options.nms:
            raise ExportError("--nms with --tensorrt is not built yet (the plan is built from the graph without NMS, "
                              "and the postprocess step runs NMS): drop --nms")
        if options.tensorrt.seq is not None:
            raise ExportError("--trt-seq is a token sequence range; a YOLO's plan takes --trt-batch only (its images' "
                              "sides range from one stride to imgsz, as the letterbox makes them)")
        _plan_batches(options.tensorrt.batch, entry)
    if options.optimize:
        raise ExportError("--optimize applies ONNX Runtime's transformer fusions; a YOLO has none: drop it")
    if options.precision not in variants.PRECISIONS:
        raise ExportError(f"unknown precision {options.precision!r}; valid: {', '.join(variants.PRECISIONS)}")
    if options.nms and options.precision != "fp32":
        raise ExportError(f"--nms with --precision {options.precision} is not built yet (NMS in the graph is fp32 "
                          "only); drop one of them")


def plan_profile(batch: str | None, entry: EntryOptions, letterbox: dict) -> Profile:
    """The plan's optimisation profile: batches 1 .. the entry's max batch size (--trt-batch MIN,OPT,MAX), and each
    side of the image from one stride (a sliver of an image keeps a row, padded to a stride) to imgsz, optimised for
    imgsz: every tensor the letterbox makes (Ultralytics' own dynamic engines take 32 to 2 x imgsz)."""
    return Profile(_plan_batches(batch, entry), side=(letterbox["stride"], letterbox["imgsz"], letterbox["imgsz"]))


def _plan_batches(batch: str | None, entry: EntryOptions) -> tuple[int, int, int]:
    """--trt-batch MIN,OPT,MAX as the entry's batching allows it (default 1,B,B)."""
    try:
        return Profile.parse(batch, max_batch_size=entry.max_batch_size).batch
    except ValueError as exc:
        raise ExportError(str(exc)) from exc


def calibration_feeds(images: list[np.ndarray], imgsz: int, batch: int) -> list[dict[str, np.ndarray]]:
    """INT8 calibration batches of one shape (TensorRT calibrates at one): each image letterboxed to the whole imgsz
    square, the incomplete last batch dropped, as Ultralytics' own INT8 engine export feeds its calibrator."""
    from ..tensorrt.plan import full_batches

    return [{"images": np.stack([imaging.letterbox(image, imgsz, imgsz) for image in chunk])}
            for chunk in full_batches(images, batch)]


def _build_plan(onnx_path: Path, plan_path: Path, images: list[np.ndarray], letterbox: dict, entry: EntryOptions,
                options, steps: Steps) -> dict:
    """The TensorRT plan of the fp32 graph at options.precision; INT8 calibrates on --calibration-images (default:
    the sample images, as the ONNX INT8 variant does). What build_plan returns, with the images it calibrated on."""
    from ..tensorrt.plan import build_plan

    trt = options.tensorrt
    profile = plan_profile(trt.batch, entry, letterbox)
    feeds = None
    if options.precision == "int8":
        calibration = [np.asarray(imaging.decode(data)) for data in trt.calibration] if trt.calibration else images
        feeds = calibration_feeds(calibration, letterbox["imgsz"], trt.calibration_batch)
    steps("building the TensorRT %s plan (profile %s; this takes minutes)", options.precision, profile.to_dict())
    info = build_plan(onnx_path, plan_path, inputs={"images": PLAN_INPUT}, profile=profile, precision=options.precision,
                      calibration_feeds=feeds, workspace_gb=trt.workspace_gb)
    return info | {"calibration_images": sum(len(feed["images"]) for feed in feeds or [])}


def _defaults(args: dict, graph_nms: dict | None) -> dict:
    """conf / iou / max_det a request gets when it names none: the run's args.yaml, else predict's defaults; with NMS in
    the graph, the graph's iou and max_det, and `graph_nms`, which the gateway holds requests to."""
    defaults = {k: args[k] if isinstance(args.get(k), (int, float)) and not isinstance(args.get(k), bool) else v
                for k, v in PREDICT_DEFAULTS.items()}
    if graph_nms is not None:
        defaults |= {"iou": graph_nms["iou"], "max_det": graph_nms["max_det"], "graph_nms": graph_nms}
    return defaults


def _default_samples(weights: Path) -> list[bytes]:
    """The run's validation images, else the synthetic samples less the saturating 16-bit gradient: over 100
    overlapping boxes scoring 1.0 to within 1e-7 make greedy NMS's choice hang on the scores' last bit, which PyTorch
    and ONNX Runtime round differently (Ultralytics' own ONNX and PyTorch predict differ there)."""
    from ..vision import sample_images

    found = validation_images(weights)
    if found:
        log.info("parity images: %d of the run's validation set (%s)", len(found), found[0].parent)
        return [p.read_bytes() for p in found]
    log.info("parity images: synthetic (the run's validation set is not on this machine; --sample-images DIR "
             "to check on yours)")
    return sample_images(saturating=False)


def _metadata(weights: Path, entry: EntryOptions, options, result: dict, parity: dict, defaults: dict,
              letterbox: dict) -> dict:
    import time

    return {
        "task": OBJECT_DETECTION, "source": str(weights.resolve()), "architecture": "UltralyticsYOLO",
        "labels": [result["names"][str(i)] for i in range(len(result["names"]))], "detection_defaults": defaults,
        "letterbox": letterbox, "image_size_varies": True, "target": entry.target,
        "instances": entry.instances, "max_batch_size": entry.max_batch_size, "command": options.command,
        "precision": options.precision, "optimized": False,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": result["versions"],
        "parity_passed": parity["passed"],
    }
