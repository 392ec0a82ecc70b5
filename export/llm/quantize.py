"""`rtxserve export llm CHECKPOINT --quantize SCHEME`: a quantised package vLLM loads as it is, made by llm-compressor
(vLLM's own project's tool) and measured against the unquantised model before anything is written.

Schemes (llm-compressor's recipes, export/llm/llmcompressor_runner.py): `w4a16` (GPTQ, int4 weights, a scale per group
of 128), `w8a8-int8` (SmoothQuant then GPTQ: int8 weights per channel, int8 activations per token), `w8a8-fp8`
(fp8 weights per channel, fp8 activations per token at run time; no calibration). The checkpoint is first made a
full-precision Hugging Face folder the way `export llm` makes one (a LoRA merged into its base, a ZeRO or Megatron
checkpoint converted, each with its own parity), then quantised in llm-compressor's environment.

Calibration: `calibration` (JSONL: {"messages": [...]} rendered with the model's chat template, or {"text": ...}), its
first `samples` lines; without it, a built-in set of prompts rendered with the chat template. Accuracy is measured on
`eval_file`, else the calibration file's tail (lines not calibrated on), else the built-in held-out prompts:
perplexity of both models, top-1 next-token agreement and mean KL per token, and greedy continuations side by side,
recorded in parity.json. A perplexity increase over `max_ppl_increase` fails the export (nothing written) unless
drift is allowed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from core.envs import LLMCOMPRESSOR

from ..checkpoint import read_json
from ..exceptions import ExportError
from ..progress import Steps
from ..tool_env import run_tool, tool_python
from ..trainers import runs
from ..triton.repository import work_dir
from .checks import inspect_llm
from .full_precision import export_full_precision
from .llmcompressor_runner import CALIBRATED, SCHEMES
from .options import LLMOptions
from .package import LLMExport, add_chat_template, package_folder, write_metadata

log = logging.getLogger(__name__)

RUNNER = Path(__file__).with_name("llmcompressor_runner.py")
RUNNER_TIMEOUT_S = 6 * 3600  # a 13B's GPTQ on a GPU takes tens of minutes; on a CPU, far longer
DEFAULT_SAMPLES = 64
HELD_OUT = 8  # the built-in prompts kept out of calibration, to measure on
# The built-in calibration and evaluation set: varied requests, rendered with the model's chat template. Your own
# data (the fine-tune's) is better: --calibration.
PROMPTS = (
    "Summarise the main causes of the French Revolution in three sentences.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "What is the difference between a list and a tuple in Python?",
    "Translate into German: The meeting has been moved to Thursday afternoon.",
    "Explain how a hash table handles collisions.",
    "Draft a polite email asking a supplier for an updated delivery date.",
    "Give me three ideas for a vegetarian dinner with lentils.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "List the steps to reset a forgotten router password.",
    "What does the SQL keyword JOIN do? Give an example query.",
    "Compose a short haiku about autumn rain in the city.",
    "How do vaccines train the immune system?",
    "Rewrite this sentence to be more formal: gonna need that report asap.",
    "What are the pros and cons of remote work for a small team?",
    "Explain the Pythagorean theorem with a worked example.",
    "Write a bash one-liner that counts the lines of every .py file in a folder.",
    "A customer says their order arrived damaged. Write a helpful reply.",
    "Describe the water cycle in four steps.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Convert 72 degrees Fahrenheit to Celsius and show the formula.",
    "Explain what a REST API is to a product manager.",
    "Suggest a name for a bakery that specialises in sourdough.",
    "What is overfitting in machine learning, and how can it be reduced?",
    "Write a limerick about a cat who learns to code.",
    "Explain the difference between TCP and UDP.",
    "Plan a three-day itinerary for a first visit to Rome.",
    "What is compound interest? Give a numeric example.",
    "Outline the plot of a mystery story set on a night train.",
    "How does photosynthesis turn light into chemical energy?",
    "Write a regular expression that matches an ISO 8601 date.",
    "What should I check before signing a flat rental contract?",
    "Explain recursion with a simple example in JavaScript.",
    "Give feedback on this opening line: It was a dark and stormy night.",
    "Describe three ways to reduce a web page's load time.",
    "What is the role of the mitochondria in a cell?",
    "Write a SQL query for the five customers with the highest total orders.",
    "Explain inflation to someone who has never studied economics.",
    "Propose an agenda for a one-hour project kickoff meeting.",
    "How do noise-cancelling headphones work?",
    "Write a short product description for a stainless steel water bottle.",
)
GREEDY_PROMPTS = PROMPTS[-3:]


@dataclass(frozen=True)
class Calibration:
    texts: list[str]  # rendered, calibrated on
    eval: list[str]  # rendered, measured on
    source: str  # where they came from


def _render(tokenizer, record: dict | str, where: str) -> str:
    """A calibration record as the model sees it: chat messages through its chat template, or plain text."""
    if isinstance(record, str):
        messages = [{"role": "user", "content": record}]
    elif isinstance(record.get("messages"), list):
        messages = record["messages"]
    elif isinstance(record.get("text"), str):
        return record["text"]
    else:
        raise ExportError(f"{where}: expected {{\"messages\": [...]}} or {{\"text\": \"...\"}}")
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=isinstance(record, str))
        except Exception as exc:  # a template that cannot render these messages
            raise ExportError(f"{where}: the chat template cannot render it ({type(exc).__name__}: {exc})") from None
    return "\n".join(str(m.get("content", "")) for m in messages)


def _jsonl(path: Path, what: str) -> list[dict]:
    if not path.is_file():
        raise ExportError(f"{what} {path} does not exist")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ExportError(f"{what} {path}, line {n}: not JSON (one JSON object per line: JSONL)") from None
        if not isinstance(record, dict):
            raise ExportError(f"{what} {path}, line {n}: expected a JSON object")
        records.append((f"{path}, line {n}", record))
    if not records:
        raise ExportError(f"{what} {path} is empty")
    return records


def read_calibration(tokenizer, calibration: Path | None, samples: int | None, eval_file: Path | None,
                     needs_data: bool) -> Calibration:
    """The rendered calibration and evaluation texts, with every file checked (ExportError naming it)."""
    if samples is not None and samples < 1:
        raise ExportError(f"--calibration-samples {samples}: calibrate on at least 1 sample")
    evaluated = [_render(tokenizer, r, w) for w, r in _jsonl(eval_file, "--eval file")] if eval_file else None
    if calibration is None:
        built_in = len(PROMPTS) - HELD_OUT
        if needs_data and samples and samples > built_in:
            raise ExportError(f"--calibration-samples {samples}: the built-in set has {built_in} prompts; give your own "
                              "data with --calibration FILE for more")
        count = samples or built_in
        texts = [_render(tokenizer, p, "built-in prompt") for p in PROMPTS[:count]]
        held = [_render(tokenizer, p, "built-in prompt") for p in PROMPTS[-HELD_OUT:]]
        return Calibration(texts if needs_data else [], evaluated or held,
                           f"{count} built-in prompts through the chat template" if needs_data else "none (fp8 dynamic)")
    records = _jsonl(Path(calibration), "--calibration file")
    tail = 0 if evaluated else max(HELD_OUT // 2, len(records) // 10)
    count = samples or min(DEFAULT_SAMPLES, len(records) - tail)
    if count < 1 or len(records) < count + tail:
        need = f"{max(count, 1)} to calibrate on" + (f" and {tail} more held out to measure on (or give --eval)"
                                                    if tail else "")
        raise ExportError(f"--calibration file {calibration} has {len(records)} records; it needs {need}")
    texts = [_render(tokenizer, r, w) for w, r in records[:count]]
    held = [_render(tokenizer, r, w) for w, r in records[-tail:]] if tail else []
    return Calibration(texts, evaluated or held, f"{count} records of {calibration}")


def _run(python: Path, request: dict, scratch: Path) -> dict:
    return run_tool(python, RUNNER, "quantize", request, scratch, "llm-compressor", RUNNER_TIMEOUT_S)


def already_quantized(config: dict) -> str | None:
    """The quantisation a checkpoint's config records (compressed-tensors, GPTQ, AWQ, bitsandbytes, ...), or None."""
    found = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return str(found.get("quant_method") or found.get("format") or "unnamed") if isinstance(found, dict) else None


def _checked_layout(source: Path, options: LLMOptions) -> str:
    """The checkpoint's layout (export.trainers.runs), once the request is checked before any work: the scheme, its
    data files (each exists and holds JSON records), and a Hugging Face checkpoint neither quantised already nor a
    vision-language model."""
    scheme = options.quantize
    if scheme not in SCHEMES:
        raise ExportError(f"unknown quantisation scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme not in CALIBRATED and options.calibration is not None:
        raise ExportError(f"{scheme} quantises activations at run time and takes no calibration data; "
                          "--calibration applies to " + " and ".join(CALIBRATED))
    for path, what in ((options.calibration, "--calibration file"), (options.eval_file, "--eval file")):
        if path is not None:
            _jsonl(Path(path), what)  # before any work: it exists, holds records, each a JSON object
    layout = runs.layout(source)
    if layout == "hf":  # what the checkpoint is, before the tool's environment is even looked for
        found = already_quantized(read_json(source / "config.json", "checkpoint"))
        if found:
            raise ExportError(f"{source} is quantised already ({found}): export it without --quantize to package it "
                              "as it is (never quantised twice)")
        if inspect_llm(source, options.chat_template).vision:  # and the weights, the tokenizer: checked here
            raise ExportError(f"{source} is a vision-language model; quantising one is not supported yet (export it "
                              "without --quantize)")
    return layout


def export_quantized(source: Path, out: Path, options: LLMOptions) -> LLMExport:
    """`export_llm` with `options.quantize`: the full-precision model (as export_llm makes it), quantised."""
    from transformers import AutoTokenizer

    scheme = options.quantize
    layout = _checked_layout(source, options)
    python = tool_python(LLMCOMPRESSOR, "setup-quantize", "quantisation with llm-compressor")
    steps = Steps(2 + (layout != "hf"), log)
    with work_dir(out) as work:
        model = source
        upstream: dict = {}
        if layout != "hf":  # a LoRA merged, a trainer's checkpoint converted: each with its own parity
            steps("making a full-precision model of %s first (%s)", source, layout)
            made = export_full_precision(source, work / "full", replace(options, quantize=None, merge=layout == "adapter",
                                                                         force=True, name=None))
            model, upstream = made.out, {k: v for k, v in made.metadata.items() if k != "parity"}
        tokenizer = AutoTokenizer.from_pretrained(model)
        if options.chat_template is not None:  # the package's template renders its calibration data too
            tokenizer.chat_template = Path(options.chat_template).read_text()
        data = read_calibration(tokenizer, options.calibration, options.calibration_samples, options.eval_file,
                                scheme in CALIBRATED)
        steps("quantising %s to %s with llm-compressor (calibration: %s); measuring it on %d held-out texts",
              model, scheme, data.source, len(data.eval))
        with package_folder(out) as pkg:
            result = _run(python, {"model": str(model), "out": str(pkg), "scheme": scheme, "calibration": data.texts,
                                   "max_seq_length": options.max_seq_length, "eval": data.eval,
                                   "prompts": [_render(tokenizer, p, "built-in prompt") for p in GREEDY_PROMPTS],
                                   "max_new_tokens": 16}, work)
            add_chat_template(pkg, options.chat_template)
            accuracy = result["accuracy"]
            increase = accuracy["perplexity_increase"]
            passed = increase <= options.max_ppl_increase
            figures = (f"perplexity {accuracy['perplexity']['reference']:.4g} -> {accuracy['perplexity']['quantized']:.4g} "
                       f"({increase:+.2%}), top-1 agreement {accuracy['top1_agreement']:.1%}, mean KL "
                       f"{accuracy['mean_kl']:.3g} on {accuracy['tokens']} tokens")
            if not passed and not options.allow_drift:
                raise ExportError(f"{scheme} costs more than --max-ppl-increase {options.max_ppl_increase * 100:.4g} %: "
                                  f"{figures}; "
                                  "nothing written (calibrate on your own data, try another scheme, or --allow-drift)")
            steps("accuracy: %s", figures)
            parity = {"quantization": {
                "scheme": scheme, "passed": passed, "max_ppl_increase": options.max_ppl_increase,
                "calibration": {"source": data.source, "samples": len(data.texts),
                                "max_seq_length": options.max_seq_length},
                "measured_on": f"{len(data.eval)} held-out texts ({accuracy['tokens']} tokens), through transformers' "
                               "compressed-tensors loader",
                **accuracy}}
            if (model / "parity.json").is_file():  # the merge's or the conversion's
                parity["before_quantization"] = json.loads((model / "parity.json").read_text())
            (pkg / "parity.json").write_text(json.dumps(parity, indent=2) + "\n")
            metadata = {"kind": "quantized", "scheme": scheme, "source": str(source.resolve()),
                        "quantized_from": upstream or {"kind": "full"}, "calibration": parity["quantization"]["calibration"],
                        "perplexity_increase": increase, "top1_agreement": accuracy["top1_agreement"],
                        "mean_kl": accuracy["mean_kl"], "parity_passed": passed, "quantized_with": result["versions"],
                        "seconds_quantizing": result["seconds"], "command": options.command}
            write_metadata(pkg, metadata)
    name = options.name or out.name
    return LLMExport("quantized", out, metadata | {"accuracy": figures},
                     f"rtxserve serve vllm {out} --served-model-name {name}", steps.seconds)
