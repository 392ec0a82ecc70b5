"""What an LLM export takes beside its source and output folder (`rtxserve export llm`'s options)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LLMOptions:
    """How to export an LLM checkpoint: everything but the source and the output folder.

    base: an adapter's base (default: the local folder the adapter records); for a ZeRO or Megatron checkpoint
        without them, the folder with its config and tokenizer.
    merge: merge a LoRA adapter into its base (checked against base+adapter) instead of packaging it for vLLM.
    qlora: None detects it (LLaMA-Factory's training_args.yaml, quantization_bit 4 or 8); True / False say so.
    dtype: of a merge or conversion ("auto": the checkpoint's).
    atol: the logits' tolerated max abs difference (default per dtype, DEFAULT_ATOL).
    allow_drift: keep a merge or conversion that breaches `atol` (parity.json records it).
    sample_prompts: prompts for the parity check (default: a built-in set, plus the chat template's rendering).
    chat_template: a Jinja file to ship as the package's chat template.
    name: the served model name (default: the output folder's name).
    force: replace an existing output folder.
    command: the command line that reproduces this export, recorded in the metadata.
    quantize: a scheme (export/llm/quantize.py): the full-precision model made as above, then quantised.
    calibration, calibration_samples, eval_file, max_seq_length: the quantisation's data (export/llm/quantize.py).
    max_ppl_increase: the perplexity increase a quantisation may cost (relative); beyond it the export fails.
    eval_set: JSON lines of chat messages or prompts (with right answers where known) for the reference set written
        into the package (default: the sample prompts).
    reference: write the reference set (the framework's greedy continuations; loads the model once more, on a GPU
        where there is one); False leaves it out (`rtxserve eval` then needs --eval-set).
    """

    base: str | Path | None = None
    merge: bool = False
    qlora: bool | None = None
    dtype: str = "auto"
    atol: float | None = None
    allow_drift: bool = False
    sample_prompts: list[str] | None = None
    chat_template: Path | None = None
    name: str | None = None
    force: bool = False
    command: str = ""
    quantize: str | None = None
    calibration: Path | None = None
    calibration_samples: int | None = None
    eval_file: Path | None = None
    max_seq_length: int = 512
    max_ppl_increase: float = 0.05
    eval_set: Path | None = None
    reference: bool = True
