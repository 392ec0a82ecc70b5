"""The generative families: LLMs (greedy continuations and their log-probabilities), Whisper (transcripts) and image
generation (a fixed-seed image).

An LLM's continuation is held to the framework's as vLLM's own model tests hold an engine to transformers
(`check_logprobs_close`): token by token until the first that differs; there, a divergence where each side's token is
in the other's top log-probabilities, and the served one nearly as likely to the framework as its own (within
`tie_logprob`), is a near tie that numerics decide (bf16 against fp32), not drift; any other is drift. The drift
figure is the mean |Δlogprob| of the chosen tokens up to there.
"""

from __future__ import annotations

import base64
import io
import math

import numpy as np

from core.tasks import SPEECH_RECOGNITION, TEXT_GENERATION, TEXT_TO_IMAGE

from .families import Answer, Family, _short

TOKEN_ID = "token_id:"


def _token(text: str) -> int:
    """A token vLLM wrote as `token_id:N` (return_tokens_as_token_ids)."""
    if not text.startswith(TOKEN_ID):
        raise ValueError(f"the engine did not return token ids (got {text!r}); is it vLLM?")
    return int(text[len(TOKEN_ID):])


def _normal(text) -> str:
    return " ".join(str(text or "").split()).casefold()


class Generation(Family):
    task = (TEXT_GENERATION,)
    route = "/v1/chat/completions"
    drift_name, drift_flag = "mean |Δlogprob|", "--max-logprob-diff"

    def body(self, model, item, ref):
        s = ref.settings
        common = {"model": model, "max_tokens": s["max_tokens"], "temperature": 0, "top_p": 1,
                  "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1.0,
                  "return_tokens_as_token_ids": True}
        if "messages" in item.input:
            return {**common, "messages": item.input["messages"], "logprobs": True, "top_logprobs": s["top_logprobs"]}
        return {**common, "prompt": item.input["prompt"], "logprobs": s["top_logprobs"]}

    def path(self, item) -> str:
        return self.route if "messages" in item.input else "/v1/completions"

    @staticmethod
    def _steps(choice: dict) -> list[tuple[int, float, dict[int, float]]]:
        """(token, its logprob, {token: logprob} of the top ones) at each position the engine answered."""
        lp = choice.get("logprobs") or {}
        if "content" in lp:  # chat
            return [(_token(c["token"]), c["logprob"], {_token(t["token"]): t["logprob"] for t in c["top_logprobs"]})
                    for c in lp["content"] or []]
        return [(_token(t), p, {_token(k): v for k, v in (top or {}).items()})
                for t, p, top in zip(lp.get("tokens", []), lp.get("token_logprobs", []), lp.get("top_logprobs", []))]

    def served_answer(self, answer):
        choice = answer["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    @staticmethod
    def gold_matches(served, gold) -> bool:
        return _normal(served) == _normal(gold)

    def compare(self, item, answer, ref):
        choice = answer["choices"][0]
        eos = set(ref.settings.get("eos_token_ids", []))
        served = self._steps(choice)
        while served and served[-1][0] in eos:
            served.pop()
        want_ids = list(item.expect["token_ids"])
        want_top = [{int(t): lp for t, lp in top} for top in item.expect["top_logprobs"]]
        while want_ids and want_ids[-1] in eos:
            want_ids.pop()
        diffs, first, tie = [], None, False
        for i in range(max(len(served), len(want_ids))):
            got = served[i][0] if i < len(served) else next(iter(eos), -1)  # ended: its end token
            want = want_ids[i] if i < len(want_ids) else next(iter(eos), -1)
            if got == want:
                diffs.append(abs(served[i][1] - want_top[i][want]))
                continue
            first = i
            theirs = want_top[i] if i < len(want_top) else {}
            ours = served[i][2] if i < len(served) else {}
            tie = (got in theirs and want in ours and theirs[want] - theirs[got] <= ref.settings["tie_logprob"])
            break
        drift = float(np.mean(diffs)) if diffs else 0.0
        text = self.served_answer(answer)
        detail = ""
        if first is not None:
            pieces = item.expect.get("tokens", [])
            detail = (f"first divergent token at {first}: served {got}, expected {want}"
                      + (f" ({pieces[first]!r})" if first < len(pieces) else "")
                      + (" (a near tie)" if tie else ""))
        gold = None
        if item.gold is not None:
            gold = {"served": self.gold_matches(text, item.gold),
                    "framework": self.gold_matches(item.expect.get("text"), item.gold)}
        return Answer(first is None or tie, drift, _short(text or ""), _short(item.expect.get("text", "")), detail, gold,
                      extra={"first_divergence": first, "near_tie": tie, "tokens_compared": len(diffs)})

    def default_limits(self, ref):
        if self.lossy(ref):
            return {"agreement": 0.8, "drift": 0.5}
        return {"agreement": 1.0, "drift": 0.1}


class Speech(Family):
    task = (SPEECH_RECOGNITION,)
    route = "/v1/audio/transcriptions"
    drift_name, drift_flag = "WER", "--max-wer"

    def request(self, model, item, ref) -> dict:
        audio = base64.b64decode(item.input["audio"])
        data = {"model": model, "temperature": "0", "response_format": "json"}
        if ref.settings.get("language"):
            data["language"] = ref.settings["language"]
        return {"files": {"file": (item.input.get("filename", "audio.wav"), audio, "application/octet-stream")},
                "data": data}

    def served_answer(self, answer):
        return " ".join(answer.get("text", "").split())

    def compare(self, item, answer, ref):
        import jiwer

        served, want = " ".join(answer.get("text", "").split()), " ".join(item.expect["text"].split())
        wer = (0.0 if served == want else 1.0) if not want else float(jiwer.wer(want, served or "∅"))
        gold = None
        if item.gold is not None:
            right = " ".join(str(item.gold).split())
            gold = {"served": served == right, "framework": want == right}
        return Answer(served == want, wer, _short(served), _short(want), gold=gold)

    def default_limits(self, ref):
        return {"agreement": 0.9, "drift": 0.1}


class Images(Family):
    task = (TEXT_TO_IMAGE,)
    route = "/v1/images/generations"
    drift_name, drift_flag = "mean |Δpixel|", "--max-pixel-diff"

    def body(self, model, item, ref):
        i = item.input
        size = i.get("size") or ref.settings["size"]
        return {"model": model, "prompt": i["prompt"], "n": 1, "size": f"{size}x{size}", "response_format": "b64_json",
                "seed": i.get("seed", ref.settings["seed"]), "num_inference_steps": i.get("steps", ref.settings["steps"])}

    def compare(self, item, answer, ref):
        from PIL import Image

        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"]))).convert("RGB"), float)
        want = np.asarray(Image.open(io.BytesIO(base64.b64decode(item.expect["image"]))).convert("RGB"), float)
        if got.shape != want.shape:
            return Answer(False, math.inf, f"{got.shape[1]}x{got.shape[0]}", f"{want.shape[1]}x{want.shape[0]}",
                          "the sizes differ")
        mse = float(np.mean((got - want) ** 2))
        psnr = math.inf if mse == 0 else 10 * math.log10(255**2 / mse)
        drift = float(np.mean(np.abs(got - want)))
        return Answer(psnr >= 30, drift, f"PSNR {psnr:.1f} dB", f"{want.shape[1]}x{want.shape[0]} PNG",
                      extra={"psnr": psnr})

    def default_limits(self, ref):
        if self.lossy(ref):
            return {"agreement": 0.5, "drift": 16.0}
        return {"agreement": 1.0, "drift": 1.0}


GENERATIVE: list[Family] = [Generation(), Speech(), Images()]
