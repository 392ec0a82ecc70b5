"""Triton python-backend model: per-token logits -> entity spans (JSON per text).

Copied into `<name>_postprocess/1/` by `rtxserve export --task token-classification`, beside
`entities.py` and the checkpoint's `tokenizer.json`. The text is tokenized again here, exactly as the
tokenizer model did, for each token's vocabulary string, character offsets and special-token flag.
Inputs:  TEXT [batch, 1] BYTES, LOGITS [batch, tokens, labels] FP32.
Output:  ENTITIES [batch, 1] BYTES: {"entities": [...], "truncated": bool, "tokens": int}.
The aggregation strategy is the `aggregation` parameter, or the request parameter `aggregation`.
"""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from entities import STRATEGIES, Token, entities  # noqa: E402


def _error(message, invalid=False):
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if invalid else None
    return pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        for key in ("labels", "aggregation", "max_length", "word_aware"):
            if key not in params:
                raise pb_utils.TritonModelException(f"ner postprocess: parameter '{key}' is missing")
        self.labels = json.loads(params["labels"])
        self.aggregation = params["aggregation"]
        self.word_aware = params["word_aware"] == "true"
        self.unk_id = int(params["unk_token_id"]) if params.get("unk_token_id", "") != "" else None
        path = os.path.join(args["model_repository"], args["model_version"], "tokenizer.json")
        self.tokenizer = Tokenizer.from_file(path)
        self.tokenizer.enable_truncation(max_length=int(params["max_length"]))
        self.tokenizer.no_padding()

    def _strategy(self, request):
        try:
            wanted = json.loads(request.parameters() or "{}").get("aggregation")
        except (AttributeError, ValueError):
            wanted = None
        return wanted or self.aggregation

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                strategy = self._strategy(request)
                if strategy not in STRATEGIES:
                    responses.append(pb_utils.InferenceResponse(error=_error(
                        f"unknown aggregation {strategy!r}; valid: {', '.join(STRATEGIES)}", invalid=True)))
                    continue
                raw = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
                texts = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in raw]
                logits = pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy()
                out = []
                for text, encoding, rows in zip(texts, self.tokenizer.encode_batch(texts), logits):
                    tokens = [Token(i, t, s, e, bool(m)) for i, t, (s, e), m in
                              zip(encoding.ids, encoding.tokens, encoding.offsets, encoding.special_tokens_mask)]
                    found = entities(text, tokens, rows, self.labels, strategy, word_aware=self.word_aware,
                                     unk_id=self.unk_id)
                    out.append(json.dumps({"entities": found, "truncated": bool(encoding.overflowing),
                                           "tokens": len(tokens)}).encode("utf-8"))
                tensor = pb_utils.Tensor("ENTITIES", np.array(out, dtype=np.object_).reshape(-1, 1))
                responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
            except Exception as exc:  # one bad request must not fail the others in the batch
                responses.append(pb_utils.InferenceResponse(error=_error(f"ner postprocess: {exc}")))
        return responses
