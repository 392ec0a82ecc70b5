"""`rtxserve export ...`: argument parsing only; the work is in the modules."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from .exceptions import ExportError

log = logging.getLogger("rtxserve.export")
EVAL_SET_HELP = ("JSON lines of inputs, with the right answer where you know it ({\"text\": ..., \"label\": ...}, "
                 "{\"image\": FILE, \"label\": ...}, {\"messages\": [...], \"answer\": ...}, {\"audio\": FILE, \"text\": ...}): "
                 "the reference set written beside the artifact holds the framework's own answers on them, which "
                 "`rtxserve eval` compares the served answers with (default: the parity check's samples)")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtxserve export", description="Export fine-tuned checkpoints for serving.")
    sub = parser.add_subparsers(dest="format", required=True)
    _add_onnx(sub.add_parser("onnx", help="ONNX, validated against PyTorch, plus a Triton ensemble entry"))
    _add_onnx(sub.add_parser("detection", help="an object detector (Ultralytics YOLO best.pt or run folder, or a "
                                               "DETR-family folder): `onnx --task object-detection`"),
              task="object-detection")
    _add_llm(sub)
    _add_speech(sub)
    _add_diffusion(sub)
    return parser


def _add_onnx(onnx, task: str | None = None) -> None:
    onnx.add_argument("checkpoint", help="folder written by save_pretrained() (model + tokenizer), a PEFT LoRA adapter "
                                         "folder (adapter_config.json), merged into its base before export, or an "
                                         "Ultralytics YOLO detector (best.pt, or the run folder with args.yaml)")
    onnx.add_argument("--base", help="an adapter's base model folder (default: the local folder the adapter records)")
    onnx.add_argument("--task", required=task is None, default=task,
                      help="what the model does: text-classification, token-classification (NER), feature-extraction "
                           "(embeddings; pooling and normalisation from the sentence-transformers files), "
                           "image-classification, object-detection (DETR family, Ultralytics YOLO)")
    onnx.add_argument("--name", required=True, help="model name clients will use")
    onnx.add_argument("--repository", type=Path, default=Path(os.environ.get("RTXSERVE_REPOSITORY", "model_repository")),
                      help="Triton model repository to write into (env RTXSERVE_REPOSITORY; default: %(default)s)")
    onnx.add_argument("--target", default="cpu", help="cpu: python-backend ONNX Runtime; gpu: native onnxruntime_onnx "
                                                       "(or tensorrt_plan with --tensorrt) on KIND_GPU instances")
    onnx.add_argument("--instances", type=int, default=1, help="model instances (instance_group count; per GPU on gpu)")
    onnx.add_argument("--gpus", default="", help="comma-separated GPU ids for --target gpu (default: all)")
    onnx.add_argument("--max-batch-size", type=int, default=32)
    onnx.add_argument("--max-queue-delay-us", type=int, default=500, help="dynamic batching delay (microseconds)")
    onnx.add_argument("--max-queue-size", type=int, default=256,
                      help="requests queued per model before Triton refuses more (0: unbounded)")
    onnx.add_argument("--queue-timeout-us", type=int, default=30_000_000,
                      help="a request queued longer is refused (microseconds; 0: no limit)")
    onnx.add_argument("--max-length", type=int, default=None,
                      help="tokens per text; longer texts are truncated (default: the model's limit)")
    onnx.add_argument("--atol", type=float, default=1e-4, help="tolerated max abs difference from PyTorch")
    onnx.add_argument("--allow-drift", action="store_true", help="keep an export that breaches --atol, or an int8 / fp16 detector "
                      "that finds less than its floor of the framework's detections")
    onnx.add_argument("--sample-texts", type=Path, help="file with one sample text per line for the parity check")
    onnx.add_argument("--eval-set", type=Path, help=EVAL_SET_HELP)
    onnx.add_argument("--force", action="store_true", help="replace an existing entry of the same name")
    onnx.add_argument("--optimize", action="store_true", help="ONNX Runtime transformer fusions (validated against --atol)")
    onnx.add_argument("--precision", default="fp32", choices=("fp32", "int8", "fp16"),
                      help="int8: dynamic quantisation for CPUs; fp16: for GPUs (both validated against --min-cosine)")
    onnx.add_argument("--min-cosine", type=float, default=None,
                      help="lowest cosine similarity to PyTorch, per row of every output, that int8 / fp16 may reach "
                           "(default 0.95 for int8, 0.999 for fp16)")

    onnx.add_argument("--sample-images", type=Path, help="folder of PNG / JPEG files for the parity check of an image model")
    onnx.add_argument("--nms", action="store_true",
                      help="object-detection, an Ultralytics YOLO: NMS in the graph (Ultralytics' nms=True), its iou and "
                           "max_det fixed at export (requests may not change them); default: NMS in the postprocess step")
    trt = onnx.add_argument_group("TensorRT (GPU machines with TensorRT 10; needs --target gpu)")
    trt.add_argument("--tensorrt", action="store_true",
                     help="build a TensorRT plan at --precision from the fp32 graph and serve it as tensorrt_plan")
    trt.add_argument("--trt-batch", help="optimisation profile batch MIN,OPT,MAX (default 1,B,B; B = --max-batch-size)")
    trt.add_argument("--trt-seq", help="optimisation profile tokens MIN,OPT,MAX (default 1,L,L; L = the max length)")
    trt.add_argument("--calibration-texts", type=Path, help="INT8: file with one calibration text per line")
    trt.add_argument("--calibration-images", type=Path, help="INT8 image models: folder of PNG / JPEG calibration images "
                     "(also, without --tensorrt, for an Ultralytics YOLO's static --precision int8)")
    trt.add_argument("--workspace-gb", type=float, default=4.0, help="TensorRT builder workspace (default: %(default)s)")
    onnx.add_argument("--aggregation", default="first", choices=("none", "simple", "first", "average", "max"),
                      help="token-classification: how sub-word predictions become entities when a request names none "
                           "(as transformers' pipeline; default: %(default)s)")


def _add_llm(sub) -> None:
    llm = sub.add_parser("llm", help="LLM fine-tune, LoRA/QLoRA adapter, DeepSpeed ZeRO or Megatron checkpoint -> "
                         "folder vLLM serves (merged on request)")
    llm.add_argument("source", help="full fine-tune folder (config.json + weights), adapter folder (adapter_config.json), "
                     "Trainer checkpoint-N folder, LLaMA-Factory output folder, DeepSpeed ZeRO checkpoint (latest, "
                     "global_stepN/) or Megatron torch_dist checkpoint (latest_checkpointed_iteration.txt, iter_N/)")
    llm.add_argument("--out", type=Path, required=True, help="folder to write the package into")
    llm.add_argument("--base", help="base model folder of an adapter (default: the base the adapter records); for a ZeRO "
                     "or Megatron checkpoint without them, the Hugging Face folder with its config and tokenizer")
    llm.add_argument("--merge", action="store_true", help="merge the adapter into its base as a standalone model")
    q = llm.add_mutually_exclusive_group()
    q.add_argument("--qlora", dest="qlora", action="store_true", default=None,
                   help="the adapter was trained against a 4- or 8-bit base (default: read LLaMA-Factory's training_args.yaml)")
    q.add_argument("--no-qlora", dest="qlora", action="store_false")
    llm.add_argument("--dtype", default="auto", help="dtype of a merged or converted model: auto (the base's or the "
                     "trainer's), float32, bfloat16, float16")
    llm.add_argument("--atol", type=float, default=None,
                     help="tolerated max abs logit difference, merged vs base+adapter or converted vs the trainer's "
                          "model (default 1e-3 for float32, 0.25 for 16-bit)")
    llm.add_argument("--allow-drift", action="store_true", help="keep a merge or conversion that breaches --atol, or "
                     "a quantisation past --max-ppl-increase")
    llm.add_argument("--sample-prompts", type=Path, help="file with one prompt per line for the parity check")
    llm.add_argument("--chat-template", type=Path, help="Jinja chat template file to add to the package")
    llm.add_argument("--eval-set", type=Path, help=EVAL_SET_HELP)
    llm.add_argument("--no-reference", dest="reference", action="store_false", help="write no reference set (it loads "
                     "the model once more to generate, on a GPU where there is one)")
    qz = llm.add_argument_group("quantisation (llm-compressor, in its own environment: make setup-quantize)")
    qz.add_argument("--quantize", choices=("w4a16", "w8a8-int8", "w8a8-fp8"),
                    help="quantise the (merged or converted) model into a compressed-tensors package vLLM loads as it is")
    qz.add_argument("--calibration", type=Path, help="JSONL of {\"messages\": [...]} or {\"text\": ...}: the "
                    "fine-tune's own data is best (default: built-in prompts through the chat template)")
    qz.add_argument("--calibration-samples", type=int, help="records to calibrate on (default: 64, or what the file "
                    "holds less its held-out tail)")
    qz.add_argument("--eval", type=Path, dest="eval_file", help="JSONL to measure the accuracy on (default: the "
                    "calibration file's tail, or built-in held-out prompts)")
    qz.add_argument("--max-seq-length", type=int, default=512, help="tokens per calibration and evaluation text")
    qz.add_argument("--max-ppl-increase", type=float, default=5.0,
                    help="the perplexity increase (%%) the quantisation may cost; beyond it, nothing is written "
                         "(default: %(default)s; --allow-drift keeps it)")
    llm.add_argument("--name", help="model name for the printed serve command (default: the --out folder's name)")
    llm.add_argument("--force", action="store_true", help="replace --out if it exists")


def _add_speech(sub) -> None:
    sp = sub.add_parser("speech", help="Whisper fine-tune -> folder vLLM serves on /v1/audio/transcriptions")
    sp.add_argument("source", help="a WhisperForConditionalGeneration folder (save_pretrained, with its processor and "
                    "generation config), or a PEFT LoRA adapter folder on one (merged into its base, with parity)")
    sp.add_argument("--base", type=Path, help="a LoRA's base Whisper folder (default: the base its adapter_config.json "
                    "records)")
    sp.add_argument("--out", type=Path, required=True, help="folder to write the package into")
    sp.add_argument("--sample-audio", type=Path, help="folder of WAV / FLAC / OGG / MP3 files: transformers' pipeline "
                    "transcribes them into parity.json, the reference the served model is held to")
    sp.add_argument("--eval-set", type=Path, help=EVAL_SET_HELP)
    sp.add_argument("--name", help="model name for the printed serve command (default: the --out folder's name)")
    sp.add_argument("--force", action="store_true", help="replace --out if it exists")


def _add_diffusion(sub) -> None:
    dif = sub.add_parser("diffusion", help="Stable Diffusion pipeline (+ LoRA) -> Triton entry for /v1/images/generations")
    dif.add_argument("pipeline", help="a diffusers pipeline folder (save_pretrained: model_index.json, unet/, vae/, ...)")
    dif.add_argument("--name", required=True, help="model name clients use (the Triton entry's name)")
    dif.add_argument("--repository", type=Path, default=Path("model_repository"))
    dif.add_argument("--lora", type=Path, help="LoRA weights (save_lora_weights' file, or its folder)")
    dif.add_argument("--lora-scale", type=float, default=1.0, help="the LoRA's strength unless a request names one")
    dif.add_argument("--fuse-lora", action="store_true", help="fold the LoRA into the weights at --lora-scale: faster "
                     "steps, but requests cannot choose another scale")
    dif.add_argument("--compile", action="store_true", help="torch.compile the UNet when the entry loads (checked here "
                     "against the eager UNet on sample latents; with a LoRA, --fuse-lora too)")
    dif.add_argument("--min-cosine", type=float, default=0.999,
                     help="--compile: lowest cosine of the compiled UNet's outputs against the eager one's")
    dif.add_argument("--steps", type=int, default=25, help="denoising steps unless a request names them")
    dif.add_argument("--guidance", type=float, default=7.5, help="guidance scale unless a request names one")
    dif.add_argument("--size", type=int, help="image side in pixels unless a request names one (default: the UNet's)")
    dif.add_argument("--instances", type=int, default=1, help="pipelines loaded at once (requests run in parallel)")
    dif.add_argument("--target", choices=("cpu", "gpu"), default="cpu", help="gpu: fp16 on KIND_GPU instances")
    dif.add_argument("--eval-set", type=Path, help=EVAL_SET_HELP)
    dif.add_argument("--no-reference", dest="reference", action="store_false", help="write no reference set (it runs "
                     "the pipeline on two probes, or the eval set, here)")
    dif.add_argument("--force", action="store_true", help="replace the entry if it exists")


def _lines(path: Path | None) -> list[str] | None:
    if path is None:
        return None
    lines = [t for t in path.read_text().splitlines() if t.strip()]
    if not lines:
        raise ExportError(f"{path} holds no text")
    return lines


def _main_llm(args, argv: list[str]) -> int:
    from .llm.llm import LLMOptions, export_llm

    try:
        result = export_llm(args.source, args.out, LLMOptions(
            base=args.base, merge=args.merge, qlora=args.qlora, dtype=args.dtype, atol=args.atol,
            allow_drift=args.allow_drift, sample_prompts=_lines(args.sample_prompts), chat_template=args.chat_template,
            name=args.name, force=args.force, command=shlex.join(["rtxserve", "export", *argv]),
            quantize=args.quantize, calibration=args.calibration, calibration_samples=args.calibration_samples,
            eval_file=args.eval_file, max_seq_length=args.max_seq_length, max_ppl_increase=args.max_ppl_increase / 100,
            eval_set=args.eval_set, reference=args.reference))
    except (ExportError, ValueError, OSError) as exc:
        return _fail("rtxserve export llm", str(exc))
    summary = f"exported {result.kind} model to {result.out} in {result.seconds:.1f}s"
    if result.kind == "quantized":
        summary += f" ({result.metadata['scheme']}: {result.metadata['accuracy']})"
    parity = result.metadata.get("parity")
    if parity:
        logits = parity["outputs"]["logits"]
        what = "conversion" if result.metadata.get("converted_from") else "merge"
        summary += (f" ({what} parity {'passed' if parity['passed'] else 'DRIFTED'}: logits max abs diff "
                    f"{logits['max_abs_diff']:.2g}, top-1 agreement {logits['top1_agreement']:.1%} on {parity['cases']} prompts)")
    print(f"{summary}\nserve it: {result.serve_command}")
    return 0


def _main_speech(args, argv: list[str]) -> int:
    from .speech.whisper import export_speech

    try:
        result = export_speech(args.source, args.out, sample_audio=args.sample_audio, base=args.base, name=args.name,
                               force=args.force, command=shlex.join(["rtxserve", "export", *argv]),
                               eval_set=args.eval_set)
    except (ExportError, ValueError, OSError) as exc:
        return _fail("rtxserve export speech", str(exc))
    print(f"exported the Whisper to {result.out} in {result.seconds:.1f}s ({len(result.metadata['languages'])} "
          f"languages, {result.metadata['chunk_length_s']} s chunks)\nserve it: {result.serve_command}")
    return 0


def _main_diffusion(args, argv: list[str]) -> int:
    from .diffusion.stable_diffusion import DiffusionDefaults, export_diffusion
    from .triton.entry import EntryOptions

    try:
        written = export_diffusion(
            args.pipeline, EntryOptions(name=args.name, target=args.target, instances=args.instances), args.repository,
            lora_path=args.lora, force=args.force, command=shlex.join(["rtxserve", "export", *argv]),
            defaults=DiffusionDefaults(steps=args.steps, guidance=args.guidance, size=args.size, lora_scale=args.lora_scale,
                                       fuse_lora=args.fuse_lora, compile=args.compile, min_cosine=args.min_cosine),
            eval_set=args.eval_set, reference=args.reference)
    except (ExportError, ValueError, OSError) as exc:
        return _fail("rtxserve export diffusion", str(exc))
    print(f"exported {args.name} to {written[0]}: serve it with `rtxserve serve triton --repository {args.repository}` "
          "and the gateway; clients call POST /v1/images/generations")
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging()
    if args.format == "llm":
        return _main_llm(args, argv)
    if args.format == "diffusion":
        return _main_diffusion(args, argv)
    if args.format == "speech":
        return _main_speech(args, argv)
    from .encoders.task_specs import check_task
    from .triton.entry import EntryOptions

    try:
        check_task(args.task)
        gpus = tuple(int(g) for g in args.gpus.split(",") if g.strip())
        opts = EntryOptions(
            name=args.name, target=args.target, instances=args.instances, max_batch_size=args.max_batch_size,
            max_queue_delay_us=args.max_queue_delay_us, max_queue_size=args.max_queue_size,
            queue_timeout_us=args.queue_timeout_us, gpus=gpus,
        )
        texts = _lines(args.sample_texts)
        from .encoders.encoder import EncoderOptions, export_encoder
        from .encoders.tensorrt_plan import TensorRTOptions
        from .encoders.inputs import read_sample_images

        images = read_sample_images(args.sample_images) if args.sample_images else None
        tensorrt, calibration_images = None, None
        if args.tensorrt:
            calibration = (_lines(args.calibration_texts) if args.calibration_texts
                           else read_sample_images(args.calibration_images) if args.calibration_images else None)
            tensorrt = TensorRTOptions(batch=args.trt_batch, seq=args.trt_seq, workspace_gb=args.workspace_gb,
                                       calibration=calibration)
        elif args.calibration_images and args.precision == "int8":  # an Ultralytics YOLO's static INT8
            calibration_images = read_sample_images(args.calibration_images)
        elif args.trt_batch or args.trt_seq or args.calibration_texts or args.calibration_images:
            raise ExportError("--trt-batch, --trt-seq and --calibration-* apply to --tensorrt builds (and "
                              "--calibration-images to a YOLO's --precision int8) only")

        result = export_encoder(args.checkpoint, args.task, opts, args.repository, EncoderOptions(
            max_length=args.max_length, atol=args.atol, allow_drift=args.allow_drift, force=args.force,
            sample_texts=texts, sample_images=images, optimize=args.optimize, tensorrt=tensorrt,
            precision=args.precision, min_cosine=args.min_cosine, aggregation=args.aggregation, base=args.base,
            calibration_images=calibration_images, nms=args.nms, eval_set=args.eval_set,
            command=shlex.join(["rtxserve", "export", *argv])))
    except (ExportError, ValueError, OSError) as exc:
        return _fail("rtxserve export", str(exc))
    print(f"exported {args.name} to {args.repository} in {result.seconds:.1f}s "
          f"({result.parity['variant']} parity {'passed' if result.parity['passed'] else 'DRIFTED'}: "
          + ", ".join(f"{k} max abs diff {v['max_abs_diff']:.2g}, min cosine {v['min_cosine']:.6f}"
                      for k, v in result.parity["outputs"].items()) + ")")
    served = result.parity.get("served")
    if served:
        print(f"served answers against {served.get('reference', 'the framework')}: {served['detail']} "
              f"({served.get('detections', 0)} detections on {served['images']} images, min box IoU "
              f"{served.get('min_box_iou', 1.0)}, max score diff {served.get('max_score_diff', 0.0):.2g})"
              + (f"; gate: {served['gate']}" if "gate" in served else ""))
    return 0

