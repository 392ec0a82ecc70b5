"""Traces to replay (`rtxserve loadtest replay TRACE`): read, checked line by line, and turned into requests
(here, where locust's processes read them; loadtest/report/replayed.py compares a replay with its trace).

Three formats, one JSON object per line:
- **rtxserve**: the gateway's own trace (`trace_dir`, serve/gateway/edge/recording.py): `t` in Unix seconds, the route, the
  model that answered, prompt and output tokens and prefix-block `hash_ids` for generation, items and characters
  (or images) for encoders.
- **mooncake**: Mooncake's traces as AIPerf replays them: `timestamp` in milliseconds, `input_length`,
  `output_length`, `hash_ids` of 512-token blocks.
- **vllm**: `vllm bench serve --dataset-name timed_trace`'s: the same fields, `timestamp` in seconds, 16-token blocks
  (the Qwen / Bailian traces' size).

A prompt is synthesised from its hash ids as vLLM's timed trace does it: each id stands for one block of words drawn
from a generator seeded by that id, so two requests that share leading ids share that prefix, and what is left of the
recorded length is drawn for that request alone. The words are ones tokenizers map to about one token each
(workloads.WORDS); the output length is forced (`max_tokens` with `ignore_eos`).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.tasks import ENCODER, TASKS, TEXT_GENERATION, routes_by_scenario

from .fitting import GENERATION, Fit
from .workloads import WORDS

FORMATS = ("auto", "rtxserve", "mooncake", "vllm")
BLOCK_TOKENS = {"mooncake": 512, "vllm": 16}
# (route, whether its inputs are images) -> API, for what a replay can synthesise: generation, text and image encoders
_INPUTS = {s: t.inputs for t in TASKS.values() if t.kind == ENCODER for s in t.loadtest}
API_OF_ROUTE = {(route, False): api for api, route in routes_by_scenario(tasks=(TEXT_GENERATION,)).items()} | {
    (route, _INPUTS[api] == "image"): api for api, route in routes_by_scenario("encoder").items()
    if _INPUTS.get(api) in ("text", "image")}


class _Line(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)


class OurLine(_Line):
    t: float = Field(ge=0)
    route: str = Field(min_length=1)
    model: str | None = None
    status: int = 200
    input_tokens: int | None = Field(default=None, ge=0)
    output_tokens: int | None = Field(default=None, ge=0)
    hash_ids: list[int] = []
    items: int | None = Field(default=None, ge=0)
    chars: int | None = Field(default=None, ge=0)
    images: int | None = Field(default=None, ge=0)
    input_hash: int | None = None
    latency_ms: float | None = Field(default=None, ge=0)
    ttft_ms: float | None = Field(default=None, ge=0)
    batch: bool = False


class TimedLine(_Line):
    timestamp: float = Field(ge=0)
    input_length: int = Field(ge=1)
    output_length: int = Field(ge=1)
    hash_ids: list[int] = []


@dataclass(frozen=True)
class Request:
    """One recorded request: when it arrived (seconds after the trace's first) and what it asked."""

    at: float
    api: str
    model: str
    input_tokens: int = 0  # generation
    output_tokens: int = 0
    hash_ids: tuple[int, ...] = ()
    items: int = 0  # encoders
    chars: int = 0
    input_hash: int | None = None  # encoders: equal for a repeated input
    recorded: dict = field(default_factory=dict, compare=False)  # latency_ms, ttft_ms, status where recorded


@dataclass
class Trace:
    requests: list[Request]
    format: str
    block_tokens: int
    skipped: Counter  # why lines were not replayed, and how many
    fitted: Counter = field(default_factory=Counter)  # what fitting it to the box changed (fitting.py), and how often

    @property
    def duration_s(self) -> float:
        return self.requests[-1].at if self.requests else 0.0

    def models(self) -> list[str]:
        return sorted({r.model for r in self.requests})


def parse_mapping(text: str) -> dict[str, str]:
    """`old=new,...` (the trace's model names to the target's)."""
    mapping = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        old, sep, new = item.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise ValueError(f"--models: expected OLD=NEW,..., not {item!r}")
        mapping[old.strip()] = new.strip()
    return mapping


def read_trace(path: Path, fmt: str = "auto", *, model: str = "", mapping: dict[str, str] | None = None,
               speed: float = 1.0, block_tokens: int = 0, fit: Fit = Fit()) -> Trace:
    """The trace's requests in arrival order, fitted to the box (`fit`: fitting.py), times divided by `speed`. Raises
    ValueError naming the line and the field of the first line that is not a trace's, or the option that leaves
    nothing to send (nothing is sent then)."""
    if fmt not in FORMATS:
        raise ValueError(f"--trace-format must be one of {', '.join(FORMATS)}")
    if speed <= 0 or block_tokens < 0:
        raise ValueError("--speed must be > 0 and --block-tokens >= 0")
    if path.is_dir():  # a gateway's trace_dir: each worker's file and its rotated ones, merged in arrival order; or a
        # fleet's, each gateway's trace_dir in a folder of its own (`kubectl cp` from each pod), merged as one
        files = sorted(p for p in path.rglob("trace-*") if ".jsonl" in p.name and p.is_file())
        if not files:
            raise ValueError(f"{path} holds no trace-*.jsonl files (the gateway's trace_dir)")
        fmt = "rtxserve" if fmt == "auto" else fmt
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"trace {path} does not exist")
    mapping = mapping or {}
    lines, skipped = [], Counter()
    for file in files:
        fmt, read = _read(file, fmt)
        lines += read
    lines.sort(key=lambda item: item[0])  # stable: equal times keep their order
    if not lines:
        raise ValueError(f"trace {path} holds no requests")
    if fmt != "rtxserve" and not model:
        raise ValueError(f"a {fmt} trace names no model: pass --model (the LLM to send its requests to)")
    requests = []
    t0 = lines[0][0]
    for at, line in lines:
        request = _request(line, at - t0, model, mapping, skipped)
        if request is not None:
            requests.append(request)
    if not requests:
        raise ValueError(f"trace {path} holds nothing a replay can send ({_reasons(skipped)})")
    blocks = block_tokens or BLOCK_TOKENS.get(fmt) or _our_block_tokens(requests)  # as recorded, before fitting
    fitted = Counter()
    requests = fit.apply(requests, speed, skipped, fitted)
    if fit.prefix_scale != 1:
        fitted[f"requests' shared prefixes scaled {fit.prefix_scale:g}x ({blocks} to {fit.block_tokens(blocks)} "
               "tokens a block)"] += sum(bool(r.hash_ids) for r in requests)
    return Trace(requests, fmt, fit.block_tokens(blocks), skipped, fitted)


def await_trace(path: Path, requests: int, timeout_s: float = 30.0) -> Trace:
    """A gateway's trace_dir once it holds `requests` requests: the gateway writes its trace every half second, so a
    recording read at once lacks its last requests (or ends in a half-written line). TimeoutError past `timeout_s`."""
    import tenacity

    def read() -> Trace | None:
        try:
            return read_trace(path)
        except ValueError:  # no file yet, or its last line half written
            return None

    trace = tenacity.Retrying(stop=tenacity.stop_after_delay(timeout_s), wait=tenacity.wait_fixed(0.1),
                              retry=tenacity.retry_if_result(lambda t: t is None or len(t.requests) < requests),
                              retry_error_callback=lambda state: state.outcome.result())(read)
    if trace is None or len(trace.requests) < requests:
        raise TimeoutError(f"{path}: {0 if trace is None else len(trace.requests)} of {requests} requests traced "
                           f"after {timeout_s:g} s")
    return trace


def _read(path: Path, fmt: str) -> tuple[str, list[tuple[float, _Line]]]:
    """One file's lines as (arrival time in seconds, line), checked; the format, found from its first line if `auto`."""
    lines, previous = [], None
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(raw, dict):
                raise ValueError(f"{where}: expected a JSON object, not {type(raw).__name__}")
            if fmt == "auto":
                fmt = "rtxserve" if "route" in raw else "mooncake"
            try:
                line = (OurLine if fmt == "rtxserve" else TimedLine).model_validate(raw)
            except ValidationError as exc:
                error = exc.errors()[0]
                name = ".".join(map(str, error["loc"])) or "line"
                raise ValueError(f"{where}: field {name!r}: {error['msg']}") from None
            # The gateway writes a line when its request ends (a long stream after the short requests that came
            # later): its lines are sorted here. A timed trace is in arrival order.
            at = line.t if fmt == "rtxserve" else line.timestamp / (1000 if fmt == "mooncake" else 1)
            if fmt != "rtxserve" and previous is not None and at < previous:
                raise ValueError(f"{where}: field 'timestamp': {raw['timestamp']} is earlier than the line before's; "
                                 "a timed trace is in arrival order")
            previous = at
            lines.append((at, line))
    return fmt, lines


def _reasons(skipped: Counter) -> str:
    return ", ".join(f"{n} {why}" for why, n in skipped.most_common()) or "none"


def _request(line, at: float, model: str, mapping: dict, skipped: Counter) -> Request | None:
    if isinstance(line, TimedLine):
        return Request(at, "chat", mapping.get(model, model), line.input_length, line.output_length,
                       tuple(line.hash_ids))
    api = API_OF_ROUTE.get((line.route, bool(line.images)))
    if line.batch:
        skipped["from the Batch API (replay its batch instead)"] += 1
    elif api is None:
        skipped[f"of {line.route} (not replayed)"] += 1
    elif not line.model:
        skipped["without a model (refused before one was chosen)"] += 1
    elif api in GENERATION and (not line.input_tokens or not line.output_tokens):
        skipped["without token counts (failed before an answer)"] += 1
    elif api not in GENERATION and not line.items:
        skipped["without input sizes (failed before reading them)"] += 1
    else:
        recorded = {k: v for k, v in (("latency_ms", line.latency_ms), ("ttft_ms", line.ttft_ms),
                                      ("status", line.status)) if v is not None}
        return Request(at, api, mapping.get(line.model, line.model), line.input_tokens or 0, line.output_tokens or 0,
                       tuple(line.hash_ids), line.items or 0, line.chars or 0, line.input_hash, recorded)
    return None


def _our_block_tokens(requests: list[Request]) -> int:
    """Our gateway hashes blocks of characters (prefix_block_chars), and only whole ones: the tokens a block stands for
    are read from the trace itself (the median of prompt tokens per block, the last, partial one counted as half)."""
    per_block = sorted(r.input_tokens / (len(r.hash_ids) + 0.5) for r in requests if r.hash_ids)
    return max(1, round(per_block[len(per_block) // 2])) if per_block else 16


def _words(seed: str, count: int, pool: list[str] = WORDS) -> list[str]:
    return random.Random(seed).choices(pool, k=count)


@dataclass(frozen=True)
class Calibration:
    """How the target reads a replayed prompt: the tokens its template adds (a chat's roles, a BOS), its tokens per
    word, and which words (indices into workloads.WORDS) it reads as one token each. With those, a hash id's block is
    exactly its tokens: a prefix cache keeps whole blocks of tokens, and a shared prefix a token short of a block
    boundary loses the whole block (vLLM's own replay, of token ids, hit twice as often as words a few tokens short)."""

    overhead: float = 0.0
    per_word: float = 1.0
    single: tuple[int, ...] = ()

    def pool(self) -> list[str]:
        """The words a prompt is made of: those one token each where at least 8 are known, else all."""
        return [WORDS[i] for i in self.single] if len(self.single) >= 8 else WORDS

    def words_for(self, tokens: float) -> int:
        """How many of pool()'s words the target reads as `tokens` tokens."""
        return max(1, round(tokens / (1.0 if len(self.single) >= 8 else self.per_word)))


def fit_calibration(count) -> dict | None:
    """A Calibration's fields from `count(text)`: the target's tokens for a prompt of `text` (None where it cannot
    say). Tokens per word from 10 and 110 words; each word's own from "the WORD" less "the" (a word after a space)."""
    counts = [count(" ".join(_words("calibration", n))) for n in (10, 110)]
    if None in counts or counts[1] <= counts[0]:
        return None
    per_word = (counts[1] - counts[0]) / 100
    base = count("the")
    single = [i for i, word in enumerate(WORDS) if base is not None and (count(f"the {word}") or 0) - base == 1]
    return {"overhead": round(max(0.0, counts[0] - 10 * per_word), 2), "per_word": round(per_word, 4),
            "single": single}


def calibrate(host: str, headers: dict, trace: Trace, timeout_s: float = 10.0) -> dict[str, dict]:
    """Per "API MODEL" of the trace's generation requests, its Calibration's fields (fit_calibration), from the
    target's own /tokenize (vLLM's, which the gateway passes on); none where it has no /tokenize."""
    import urllib.request

    found = {}
    for api, model in sorted({(r.api, r.model) for r in trace.requests if r.api in GENERATION}):
        def count(text: str) -> int | None:
            body = {"model": model} | ({"messages": [{"role": "user", "content": text}]} if api == "chat" else
                                       {"prompt": text})
            request = urllib.request.Request(f"{host.rstrip('/')}/tokenize", data=json.dumps(body).encode(),
                                             headers={**headers, "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                    return int(json.load(answer)["count"])
            except (OSError, ValueError, KeyError, TypeError):
                return None

        fitted = fit_calibration(count)
        if fitted is not None:
            found[f"{api} {model}"] = fitted
    return found


def _salted(seed: str, loop: int) -> str:
    """A seed of the trace's `loop`-th pass (--loop-trace): each pass new traffic of the same shape (the first: as is)."""
    return seed if loop == 0 else f"pass {loop}: {seed}"


def prompt(request: Request, block_tokens: int, index: int, calibration: Calibration = Calibration(),
           loop: int = 0) -> str:
    """The request's prompt: a block of words per hash id (the same id, the same words), then words of its own up to
    the recorded length, in words as the target reads them (`calibration`). `index` (the request's place in the
    trace) seeds its own words; `loop`, the pass of a looped trace, all of them."""
    total = calibration.words_for(request.input_tokens - calibration.overhead)
    block_words = calibration.words_for(block_tokens)
    pool = calibration.pool()
    words: list[str] = []
    for block in request.hash_ids:
        if len(words) >= total:
            break
        words += _words(_salted(f"block {block}", loop), min(block_words, total - len(words)), pool)
    words += _words(_salted(f"request {index}", loop), total - len(words), pool)
    return " ".join(words)


def seed(request: Request, index: int, loop: int = 0) -> str:
    """What an encoder request's made-up inputs are drawn from: its inputs' hash where recorded (a repeated input is
    sent again as the same), else its place in the trace."""
    return _salted(f"input {request.input_hash}" if request.input_hash is not None else f"request {index}", loop)


def texts(request: Request, index: int, loop: int = 0) -> list[str]:
    """An encoder request's inputs: its recorded number of texts, of its recorded characters in all."""
    each = max(1, request.chars // max(1, request.items))
    rng = random.Random(seed(request, index, loop))
    out = []
    for _ in range(request.items):
        text = ""
        while len(text) < each:
            text += rng.choice(WORDS) + " "
        out.append(text[:each].strip() or rng.choice(WORDS))
    return out


def from_options(options) -> Trace:
    """The trace `--scenario replay` sends, from the scenario options (argparse's namespace)."""
    if not options.trace:
        raise ValueError("--scenario replay needs --trace FILE")
    return read_trace(Path(options.trace), options.trace_format, model=options.model,
                      mapping=parse_mapping(options.models), speed=options.speed, block_tokens=options.block_tokens,
                      fit=Fit.from_options(options))
