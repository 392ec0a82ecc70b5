"""One call per gateway API, each checking its answer (answers.py): a wrong answer (fewer results than inputs, no
tokens, a stream cut short) is a failure with the reason, not a success. A streamed request's latency is the whole
answer, replacing locust's own time (with stream=True that stops at the response headers).
"""

from __future__ import annotations

import base64
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.tasks import ENCODER, TASKS, TEXT_GENERATION, TEXT_RANKING, routes_by_scenario

from . import replayer, workloads
from .answers import WrongAnswer, answered_by, check_encoded, failed_status, read_stream, whole_answer
from .options import parse_mix, word_range

# scenario -> the gateway route it calls (core/tasks.py)
ENCODER_APIS = routes_by_scenario("encoder")
GENERATION_APIS = routes_by_scenario(tasks=(TEXT_GENERATION,))
RANK_APIS = routes_by_scenario(tasks=(TEXT_RANKING,))
IMAGES_API = routes_by_scenario("diffusion")["images"]
SPEECH_APIS = routes_by_scenario("speech")
# The encoder scenarios that send images (image, detect; a folder as --dataset), from the registry.
IMAGE_APIS = {s for t in TASKS.values() if t.kind == ENCODER and t.inputs == "image" for s in t.loadtest}


@dataclass
class Load:
    """What one locust process sends, built once from the command-line options."""

    options: object
    entries: list[tuple[str, str]] = field(default_factory=list)  # (api, model)
    weights: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    audio: list[workloads.Audio] = field(default_factory=list)  # the speech scenarios' uploads (--audio-dir)
    chat_images: list[str] = field(default_factory=list)  # data URLs attached to chat requests (--chat-images)
    prompts: list[workloads.Prompt] = field(default_factory=list)
    headers: dict = field(default_factory=dict)
    system_prompt: str = ""  # chat: what every conversation opens with (--system-prompt-words)
    trace: replayer.Trace | None = None  # --scenario replay: the trace whose requests are sent
    calibration: dict = field(default_factory=dict)  # --scenario replay: how the target reads its words (replayer.py)

    @classmethod
    def from_options(cls, options, index: int = 0, trace: replayer.Trace | None = None) -> "Load":
        """`trace`: --scenario replay's, where it was read already (else it is read here)."""
        load = cls(options)
        if options.api_key:
            load.headers["Authorization"] = f"Bearer {options.api_key}"
        if options.scenario == "replay":
            if options.arrival != "trace":
                raise ValueError("--scenario replay sends at the trace's arrival times: --arrival trace")
            load.trace = trace or replayer.from_options(options)
            load.calibration = json.loads(options.calibration) if options.calibration else {}
            load.entries = sorted({(r.api, r.model) for r in load.trace.requests})
            if {api for api, _ in load.entries} & IMAGE_APIS:
                load.images = workloads.images_base64(None)
            return load
        if options.arrival == "trace":
            raise ValueError("--arrival trace is --scenario replay's (give --trace FILE)")
        if options.scenario == "mix":
            mix = parse_mix(options.mix)
            load.entries, load.weights = [(a, m) for a, m, _ in mix], [w for _, _, w in mix]
        else:
            models = [m.strip() for m in options.model.split(",") if m.strip()]
            if not models:
                raise ValueError("--model is required")
            if options.zipf < 0:
                raise ValueError("--zipf must be >= 0")
            load.entries = [(options.scenario, m) for m in models]
            load.weights = [1 / rank**options.zipf for rank in range(1, len(models) + 1)]  # Zipf's law over the ranks
        if options.batch < 1 or options.output_len < 1:
            raise ValueError("--batch and --output-len must be >= 1")
        apis = {api for api, _ in load.entries}
        dataset = Path(options.dataset) if options.dataset else None
        if dataset is not None and not dataset.exists():
            raise ValueError(f"dataset {dataset} does not exist")
        fits = dataset is None or (dataset.is_dir() and bool(apis & IMAGE_APIS)) or (
            dataset.is_file() and bool(apis & {"classify", "ner", "embeddings", "images", *RANK_APIS, *GENERATION_APIS}))
        if not fits:  # never fall back to the built-in workload behind the user's back
            raise ValueError(f"--dataset {dataset} fits none of {', '.join(sorted(apis))}: texts and prompts come "
                             "from a file, images from a folder")
        if options.workload == "file" and dataset is None:
            raise ValueError("--workload file needs --dataset")
        if apis & {"classify", "ner", "embeddings", "images", *RANK_APIS}:  # texts; for images, the prompts
            load.texts = workloads.read_texts(dataset) if dataset and dataset.is_file() else workloads.TEXTS
        if apis & SPEECH_APIS.keys():
            if not options.audio_dir:
                raise ValueError(f"--scenario {'/'.join(sorted(apis & SPEECH_APIS.keys()))} needs --audio-dir DIR (audio "
                                 "files to upload; `rtxserve fixtures whisper` writes some in whisper/audio)")
            load.audio = workloads.read_audio(Path(options.audio_dir))
        if apis & IMAGE_APIS:
            load.images = workloads.images_base64(dataset if dataset and dataset.is_dir() else None)
        if apis & GENERATION_APIS.keys():
            load.prompts = load._prompts(dataset, options.seed + index)
        if options.turns < 1 or options.system_prompt_words < 0:
            raise ValueError("--turns must be >= 1 and --system-prompt-words >= 0")
        if (options.turns > 1 or options.system_prompt_words) and "chat" not in apis:
            raise ValueError("--turns and --system-prompt-words apply to chat requests")
        if options.turns > 1 and options.arrival != "closed":
            raise ValueError("--turns applies to the closed loop: a conversation's next turn waits for its answer")
        if options.system_prompt_words:  # the same words in every process: one prefix for all
            load.system_prompt = workloads.system_prompt(options.seed, options.system_prompt_words)
        if options.chat_images < 0 or (options.chat_images and "chat" not in apis):
            raise ValueError("--chat-images must be >= 0, and applies to chat requests")
        if options.image_dir and not options.chat_images:
            raise ValueError("--image-dir is the folder of the images --chat-images attaches; give --chat-images N")
        if options.chat_images:
            load.chat_images = [data_url(b) for b in (workloads.read_images(Path(options.image_dir))
                                                      if options.image_dir else workloads.builtin_images())]
        return load

    def _prompts(self, dataset: Path | None, seed: int) -> list[workloads.Prompt]:
        o = self.options
        if o.workload == "random":
            if not o.tokenizer:
                raise ValueError("--workload random needs --tokenizer (the model's tokenizer.json or its folder)")
            path = Path(o.tokenizer)
            return workloads.random_token_prompts(path / "tokenizer.json" if path.is_dir() else path, o.num_prompts,
                                                  o.input_len, o.output_len, o.range_ratio, seed)
        if dataset is not None and dataset.is_file():
            return workloads.read_prompts(dataset)
        return workloads.builtin_prompts(random.Random(seed), 256, word_range(o.prompt_words))

    @property
    def ignore_eos(self) -> bool:
        return self.options.ignore_eos == "on" or (self.options.ignore_eos == "auto" and (
            self.options.workload == "random" or self.trace is not None))  # the recorded output length, forced

    def pick(self, rng: random.Random) -> tuple[str, str]:
        return self.entries[0] if len(self.entries) == 1 else rng.choices(self.entries, self.weights)[0]


def call(user, api: str, model: str, rng: random.Random, context: dict | None = None) -> float:
    """One request of `api` for `model` through the user's locust client; `context` rides along to the
    raw-sample row (e.g. how long an open-loop arrival waited for a slot). Returns the seconds a client that
    honours Retry-After waits before its next request (0 if none)."""
    if api in GENERATION_APIS:
        return _generate(user, api, model, rng, context or {})
    if api == "images":
        return _images(user, model, rng, context or {})
    if api in SPEECH_APIS:
        return _speech(user, api, model, rng, context or {})
    if api in RANK_APIS:
        return _rank(user, api, model, rng, context or {})
    return _encode(user, api, model, rng, context or {})


def replay(user, index: int, request, loop: int, context: dict) -> None:
    """The trace's `index`-th request (a replayer.Request) in its `loop`-th pass, its input synthesised at its recorded
    size."""
    if request.api in GENERATION_APIS:
        calibration = user.load.calibration.get(f"{request.api} {request.model}") or {}
        text = replayer.prompt(request, user.load.trace.block_tokens, index, replayer.Calibration(**calibration), loop)
        _generate(user, request.api, request.model, random.Random(index), context,
                  workloads.Prompt([{"role": "user", "content": text}], max_tokens=request.output_tokens))
    else:
        rng = random.Random(replayer.seed(request, index, loop))
        inputs = [{"image": i} for i in rng.choices(user.load.images, k=request.items)] if request.api in IMAGE_APIS \
            else replayer.texts(request, index, loop)
        _encode(user, request.api, request.model, rng, context, inputs)


def _retry_after(user, response) -> float:
    retry_after = response.headers.get("retry-after") if response.headers else None
    if not (user.load.options.honour_retry_after and response.status_code in (429, 503) and retry_after):
        return 0.0
    try:
        return max(0.0, float(retry_after))
    except ValueError:  # an HTTP date: our gateway sends seconds; wait a second rather than guess
        return 1.0


def _encode(user, api: str, model: str, rng: random.Random, context: dict, inputs: list | None = None) -> float:
    load = user.load
    n = load.options.batch if inputs is None else len(inputs)
    if inputs is None:
        inputs = [{"image": i} for i in rng.choices(load.images, k=n)] if api in IMAGE_APIS else rng.choices(load.texts, k=n)
    if api == "detect":
        context["images"] = n
    with user.client.post(ENCODER_APIS[api], json={"model": model, "input": inputs}, name=api, headers=load.headers,
                          catch_response=True, context=context) as response:
        if failed_status(response):
            return _retry_after(user, response)
        try:
            answer = response.json()
            data = answer.get("data")
            check_encoded(api, data, n)
            answered_by(response, answer)
            if api == "detect":
                found = sum(len(d["detections"]) for d in data)
                response.request_meta["context"]["detections"] = found  # locust copied `context` into the request
        except (WrongAnswer, ValueError, AttributeError) as exc:
            response.failure(f"wrong answer: {exc}")
    return 0.0


def _rank(user, api: str, model: str, rng: random.Random, context: dict) -> float:
    """One rerank of --batch documents against a query (or their scores against it), all drawn from the texts: a
    score for every document, or a failure saying what came back."""
    load = user.load
    n = load.options.batch
    query, *documents = rng.choices(load.texts, k=n + 1)
    body = {"model": model, "query": query, "documents": documents} if api == "rerank" else \
        {"model": model, "queries": query, "documents": documents}
    with user.client.post(RANK_APIS[api], json=body, name=api, headers=load.headers, catch_response=True,
                          context=context) as response:
        if failed_status(response):
            return _retry_after(user, response)
        try:
            answer = response.json()
            results = answer.get("results") if api == "rerank" else answer.get("data")
            if not isinstance(results, list) or len(results) != n:
                raise WrongAnswer(f"expected {n} scores, got {len(results) if isinstance(results, list) else results!r}")
            if not all(isinstance(r.get("relevance_score" if api == "rerank" else "score"), (int, float)) for r in results):
                raise WrongAnswer("a result has no score")
            answered_by(response, answer)
        except (WrongAnswer, ValueError, AttributeError) as exc:
            response.failure(f"wrong answer: {exc}")
    return 0.0


def _images(user, model: str, rng: random.Random, context: dict) -> float:
    """One image generation of --batch images: a whole, decodable PNG for each, or a failure saying which."""
    import binascii
    import io

    from PIL import Image

    load = user.load
    n = load.options.batch
    body = {"model": model, "prompt": rng.choice(load.texts), "n": n, "response_format": "b64_json",
            "seed": rng.randrange(2**31)}
    if load.options.image_size:
        body["size"] = load.options.image_size
    if load.options.image_steps:
        body["num_inference_steps"] = load.options.image_steps
    context["images"] = n
    with user.client.post(IMAGES_API, json=body, name="images", headers=load.headers, catch_response=True,
                          context=context) as response:
        if failed_status(response):
            return _retry_after(user, response)
        try:
            data = response.json().get("data")
            if not isinstance(data, list) or len(data) != n:
                raise WrongAnswer(f"expected {n} images, got {len(data) if isinstance(data, list) else type(data).__name__}")
            for i, item in enumerate(data):
                with Image.open(io.BytesIO(base64.b64decode(item.get("b64_json") or "", validate=True))) as image:
                    if image.format != "PNG":
                        raise WrongAnswer(f"image {i} is {image.format}, not PNG")
                    image.verify()  # a truncated or corrupt file fails here
        except (WrongAnswer, ValueError, AttributeError, binascii.Error, OSError) as exc:
            response.failure(f"wrong answer: {exc}")
    return 0.0


def _speech(user, api: str, model: str, rng: random.Random, context: dict) -> float:
    """One upload as OpenAI's audio API takes it (multipart): a transcript that is a string, or a failure."""
    load = user.load
    audio = rng.choice(load.audio)
    from urllib3 import encode_multipart_formdata  # locust's fast client sends bytes; urllib3 writes the form

    form = {"model": model, **({"language": load.options.language} if load.options.language else {}),
            "file": (audio.name, audio.data)}
    body, content_type = encode_multipart_formdata(form)
    context["audio_s"] = audio.seconds
    with user.client.post(SPEECH_APIS[api], data=body, name=api, headers={**load.headers, "Content-Type": content_type},
                          catch_response=True, context=context) as response:
        if failed_status(response):
            return _retry_after(user, response)
        try:
            if not isinstance(response.json().get("text"), str):
                raise WrongAnswer("no text in the answer")
        except (WrongAnswer, ValueError, AttributeError) as exc:
            response.failure(f"wrong answer: {exc}")
    return 0.0


def data_url(image: bytes) -> str:
    mime = "image/png" if image[:8] == b"\x89PNG\r\n\x1a\n" else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(image).decode()}"


def with_images(messages: list[dict], urls: list[str]) -> list[dict]:
    """The messages with `urls` attached to the last user message, as OpenAI image_url parts after its text."""
    last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
    content = messages[last]["content"]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [*messages[:last], {**messages[last], "content": parts}, *messages[last + 1:]]


@dataclass
class Conversation:
    """A user's multi-turn chat (--turns): its messages so far, the turns sent, its x-session-id."""

    messages: list[dict]
    session: str
    turns: int = 0


def _chat_messages(user, load: Load, prompt: workloads.Prompt, rng: random.Random, context: dict) -> list[dict]:
    """The messages of the user's next chat request: a new conversation (the shared system prompt, then the prompt),
    or the next turn of the one it holds (its history, then the prompt's last question)."""
    o = load.options
    conversation = getattr(user, "conversation", None)
    if o.turns == 1 or conversation is None or conversation.turns >= o.turns:
        system = [{"role": "system", "content": load.system_prompt}] if load.system_prompt else []
        conversation = Conversation(system + list(prompt.messages), f"{rng.getrandbits(64):016x}")
        if o.turns > 1:
            user.conversation = conversation
    else:
        question = next(m for m in reversed(prompt.messages) if m.get("role") == "user")
        conversation.messages.append(question)
    conversation.turns += 1
    context["turn"] = conversation.turns
    if o.turns > 1:
        context["session"] = conversation.session
    return conversation.messages


def _generation_body(load: Load, api: str, model: str, prompt: workloads.Prompt, rng: random.Random,
                     messages: list[dict] | None = None) -> dict:
    o = load.options
    body = {"model": model, "max_tokens": prompt.max_tokens or o.output_len}
    if api == "chat":
        messages = messages or prompt.messages
        body["messages"] = (with_images(messages, rng.choices(load.chat_images, k=o.chat_images))
                            if load.chat_images else messages)
    else:
        body["prompt"] = prompt.text
    if not o.no_stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if load.ignore_eos:
        body["ignore_eos"] = True
    if o.temperature is not None:
        body["temperature"] = o.temperature
    return body


def _generate(user, api: str, model: str, rng: random.Random, context: dict,
              prompt: workloads.Prompt | None = None) -> float:
    load = user.load
    prompt = prompt or rng.choice(load.prompts)
    multi_turn = api == "chat" and (load.options.turns > 1 or load.system_prompt)
    messages = _chat_messages(user, load, prompt, rng, context) if multi_turn else None
    body = _generation_body(load, api, model, prompt, rng, messages)
    headers = {**load.headers, "x-session-id": context["session"]} if "session" in context else load.headers
    stream = body.get("stream", False)
    started = time.perf_counter()
    with user.client.post(GENERATION_APIS[api], json=body, name=api, headers=headers, stream=stream,
                          catch_response=True, context=context) as response:
        if failed_status(response):
            return _retry_after(user, response)
        try:
            if stream:
                # geventhttpclient's readline returns each line as it arrives (iter_content(n) would wait
                # for n bytes and batch the tokens).
                figures = read_stream(iter(lambda: response._response.readline(b"\n"), b""), started)
            else:
                figures = whole_answer(response.json())
            if load.ignore_eos and figures["output_tokens"] != body["max_tokens"]:
                raise WrongAnswer(f"ignore_eos: expected {body['max_tokens']} tokens, got {figures['output_tokens']}")
            if messages is not None and load.options.turns > 1:  # the answer joins the history the next turn sends
                messages.append({"role": "assistant", "content": figures["text"]})
            response.request_meta["context"].update(figures)  # locust copied `context` into the request
        except (WrongAnswer, ValueError, AttributeError) as exc:
            response.failure(f"wrong answer: {exc}")
            user.conversation = None  # a conversation whose answer is missing is not continued
        except OSError as exc:  # the connection broke mid-answer
            response.failure(f"stream cut: {type(exc).__name__}")
            user.conversation = None
        finally:
            response.request_meta["response_time"] = (time.perf_counter() - started) * 1000
    return 0.0
