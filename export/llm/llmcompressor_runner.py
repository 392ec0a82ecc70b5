"""Runs inside the llm-compressor environment (`.envs/llmcompressor`, `make setup-quantize`): llm-compressor pins its
own transformers. export/llm/quantize.py starts this file with that environment's Python (`python -P`, so that
export/'s own modules do not shadow installed ones; export/tool_env.py's run_tool) and reads back what it writes.

    python -P llmcompressor_runner.py quantize REQUEST.json

Three modules of rtxserve also import it, in rtxserve's own environment, so its top imports nothing but the standard
library (llm-compressor, torch and numpy only inside the functions that run here): export/llm/quantize.py reads its
SCHEMES and CALIBRATED; benchmark B8 (bench/quantize.py, bfloat16 measured as the schemes are) and
tests/unit/test_quantize.py run its accuracy measure (_token_ids, _reference_pass, _accuracy) in-process.

REQUEST.json: {"model": a Hugging Face folder, "out": the folder to write the quantised model into, "scheme": one of
SCHEMES, "calibration": [texts], "max_seq_length", "eval": [texts], "prompts": [texts], "max_new_tokens"}. The texts
come rendered (chat template applied) by rtxserve.

It writes into `out` the compressed-tensors checkpoint vLLM loads as it is (and the tokenizer), then loads it back
through transformers' compressed-tensors loader and measures it against the unquantised model on the `eval` texts:
perplexity of both, top-1 next-token agreement and mean KL divergence per token, and each prompt's greedy
continuation from both. Those figures, with what ran, go to result.json beside the request.
An error the user can act on is written as {"error": "..."} to result.json, with exit status 3.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

EXIT_REFUSED = 3


def recipe(scheme: str) -> list:
    """llm-compressor's recipes for each scheme; lm_head stays in the model's dtype, as vLLM expects."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    if scheme == "w4a16":  # int4 weights, a scale per group of 128, 16-bit activations (Marlin on GPUs)
        return [GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])]
    if scheme == "w8a8-int8":  # int8 weights per channel, int8 activations per token; SmoothQuant first
        return [SmoothQuantModifier(smoothing_strength=0.8),
                GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]
    if scheme == "w8a8-fp8":  # fp8 weights per channel, fp8 activations per token at run time: no calibration
        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])]
    raise ValueError(scheme)


SCHEMES = ("w4a16", "w8a8-int8", "w8a8-fp8")
CALIBRATED = ("w4a16", "w8a8-int8")  # fp8 dynamic needs no data


def _refuse(work: Path, message: str) -> None:
    (work / "result.json").write_text(json.dumps({"error": message}))
    sys.exit(EXIT_REFUSED)


def _token_ids(tokenizer, texts: list[str], max_seq_length: int) -> list:
    """Each evaluation text's token ids, those with a token to predict."""
    ids = [tokenizer(t, return_tensors="pt", truncation=True, max_length=max_seq_length).input_ids for t in texts]
    ids = [i for i in ids if i.shape[1] >= 2]
    if not ids:
        raise ValueError("the evaluation texts hold no token to predict")
    return ids


def _log_probs(model, ids):
    import torch

    with torch.no_grad():
        return model(ids).logits[0, :-1].float().log_softmax(-1)


def _reference_pass(model, ids: list, store: Path):
    """The reference's next-token log-probabilities for every evaluation token, written to a disk-backed array at
    `store` (float32, exact): the quantised model is then measured against it with one model in memory at a time.
    Returns the array and the reference's summed negative log-likelihood."""
    import numpy as np

    rows = sum(i.shape[1] - 1 for i in ids)
    table, nll, at = None, 0.0, 0
    for i in ids:
        ref = _log_probs(model, i)
        if table is None:
            table = np.lib.format.open_memmap(store, mode="w+", dtype=np.float32, shape=(rows, ref.shape[-1]))
        table[at:at + len(ref)] = ref.numpy()
        nll -= float(ref.gather(1, i[0, 1:, None]).sum())
        at += len(ref)
    table.flush()
    return table, nll


def _accuracy(reference_table, reference_nll: float, quantized, ids: list) -> dict:
    """Perplexity of both models, and per predicted token: top-1 agreement and KL(reference || quantised)."""
    import math

    import torch

    nll, agree, kl, at = 0.0, 0, 0.0, 0
    for i in ids:
        got = _log_probs(quantized, i)
        ref = torch.from_numpy(reference_table[at:at + len(got)])
        nll -= float(got.gather(1, i[0, 1:, None]).sum())
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        kl += float((ref.exp() * (ref - got)).sum())
        at += len(got)
    tokens = at
    ppl = {"reference": math.exp(reference_nll / tokens), "quantized": math.exp(nll / tokens)}
    return {"tokens": tokens, "perplexity": ppl, "perplexity_increase": ppl["quantized"] / ppl["reference"] - 1,
            "top1_agreement": agree / tokens, "mean_kl": kl / tokens}


def _continuations(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    import torch

    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:]
        out.append(tokenizer.decode(new, skip_special_tokens=True))
    return out


def quantize(request: dict, work: Path) -> None:
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    scheme, model_dir, out = request["scheme"], request["model"], Path(request["out"])
    if scheme not in SCHEMES:
        _refuse(work, f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    length = request["max_seq_length"]
    calibration = None
    if scheme in CALIBRATED:
        calibration = Dataset.from_dict({"text": request["calibration"]}).map(
            lambda row: tokenizer(row["text"], truncation=True, max_length=length, add_special_tokens=False),
            remove_columns=["text"])
    oneshot(model=model, dataset=calibration, recipe=recipe(scheme), max_seq_length=length,
            num_calibration_samples=len(request["calibration"]) if calibration is not None else 0)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    seconds = time.perf_counter() - start
    del model
    # Both sides as vLLM's weights would be read: the quantised one through transformers' compressed-tensors loader,
    # decompressed (run_compressed=False: CPU kernels for the packed formats are vLLM's, not transformers'), so
    # its activations are quantised as the scheme says and its weights are what was stored. One model in memory at a
    # time (a 13B in float32 is 52 GB): the reference's answers are kept, on disk, for the quantised one's turn.
    ids, new, prompts = _token_ids(tokenizer, request["eval"], length), request["max_new_tokens"], request["prompts"]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    store = work / "reference-logprobs.npy"
    table, reference_nll = _reference_pass(reference, ids, store)
    reference_greedy = _continuations(reference, tokenizer, prompts, new)
    del reference
    quantized = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    accuracy = _accuracy(table, reference_nll, quantized, ids)
    del table
    store.unlink()
    accuracy["greedy"] = [{"prompt": p, "reference": r, "quantized": q} for p, r, q in zip(
        prompts, reference_greedy, _continuations(quantized, tokenizer, prompts, new))]
    (work / "result.json").write_text(json.dumps({
        "seconds": seconds, "accuracy": accuracy,
        "versions": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__}}))


if __name__ == "__main__":
    path = Path(sys.argv[2])
    commands = {"quantize": quantize}
    commands[sys.argv[1]](json.loads(path.read_text()), path.parent)
