"""The load test's own command-line options, added to locust's (so `locust -f loadtest/scenarios/locustfile.py
--scenario chat --model m ...` works as well as `rtxserve loadtest run`). Locust passes them on to its workers.

Named so that they cannot collide with the gateway's RTXSERVE_* settings: nothing here reads the environment.
Nothing here imports locust (which patches the standard library with gevent on import), so that the runner
can check a run's options in its own process before it starts any load.
"""

from __future__ import annotations

from core.tasks import TASKS

# Each task's scenarios (core/tasks.py: classify, ner, embeddings, image, detect, chat, completions, images), and mix.
SCENARIOS = (*(scenario for task in TASKS.values() for scenario in task.loadtest), "mix", "replay")
ARRIVALS = ("closed", "poisson", "gamma", "trace")
WORKLOADS = ("builtin", "random", "file")


def add_options(parser):
    """Add the options to `parser` (locust's, through events.init_command_line_parser, or an argparse one)."""
    group = parser.add_argument_group("rtxserve", "what each request sends and how requests arrive")
    _request_options(group)
    _workload_options(group)
    _arrival_options(group)
    group.add_argument("--api-key", default="", help="the gateway key, sent as Authorization: Bearer")
    group.add_argument("--seed", type=int, default=0, help="workload and arrival seed (each process adds its index)")
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    group.add_argument("--samples-out", default="", help="CSV of raw per-request samples (written by the master)")
    _replay_options(parser)


def _request_options(group) -> None:
    """What each request asks for: the API (scenario), its model(s), and its inputs per request."""
    group.add_argument("--scenario", choices=SCENARIOS, default="classify",
                       help="API under load: classify (texts), image (classify images), ner, embeddings, chat, "
                            "completions, images (generations), mix (--mix), or replay (--trace)")
    group.add_argument("--model", default="", help="model name the requests ask for; several, comma-separated: each "
                       "request asks for one of them, drawn with Zipf popularity (--zipf)")
    group.add_argument("--zipf", type=float, default=1.0, help="with several --model names: the k-th named is asked for "
                       "in proportion to 1/k^s (s = this; 0: all alike), the popularity of fine-tunes on one box")
    group.add_argument("--mix", default="", metavar="API:MODEL:WEIGHT,...",
                       help="--scenario mix: APIs with their model and a weight per request, e.g. "
                            "classify:reviews:3,chat:tiny-llama:1")
    group.add_argument("--batch", type=int, default=1, help="classify / ner / embeddings: inputs per request; "
                       "images: images per request (n)")
    group.add_argument("--image-size", default="", metavar="WxH", help="images: the size asked (default: the model's)")
    group.add_argument("--image-steps", type=int, default=0, help="images: denoising steps (default: the model's)")
    group.add_argument("--chat-images", type=int, default=0, help="chat: images attached to each request's last user "
                       "message as data URLs, for vision-language models (TTFT then includes encoding them)")
    group.add_argument("--image-dir", default="", help="chat with --chat-images: a folder of .png / .jpg images to "
                       "attach (default: built-in PNGs)")
    group.add_argument("--audio-dir", default="", help="transcribe / translate: a folder of .wav / .flac / .ogg / .mp3 "
                       "files to upload (`rtxserve fixtures whisper` writes some in whisper/audio)")
    group.add_argument("--language", default="", help="transcribe: the language sent (default: none, the model detects it)")


def _workload_options(group) -> None:
    """What the requests hold: the texts, images or prompts (built in, random tokens, or a dataset), their lengths, a
    chat's turns, and the generation settings sent."""
    group.add_argument("--workload", choices=WORKLOADS, default="builtin",
                       help="builtin texts, images and word prompts; random token prompts (needs --tokenizer); "
                            "or --dataset")
    group.add_argument("--dataset", default="", help="a .txt / .jsonl of texts, a .jsonl of prompts or ShareGPT "
                                                    "conversations (.json / .jsonl), or a folder of images")
    group.add_argument("--tokenizer", default="", help="random workload: the model's tokenizer.json (or its folder)")
    group.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens (mean)")
    group.add_argument("--output-len", type=int, default=64, help="max_tokens of each generation (mean for random)")
    group.add_argument("--range-ratio", type=float, default=0.0,
                       help="random workload: lengths drawn uniformly within ±ratio of the mean, as vLLM's")
    group.add_argument("--prompt-words", default="4,120", metavar="MIN,MAX",
                       help="builtin workload: words per prompt, drawn uniformly")
    group.add_argument("--num-prompts", type=int, default=256, help="random workload: distinct prompts per process")
    group.add_argument("--turns", type=int, default=1, help="chat: turns per conversation. Above 1 each user holds a "
                       "conversation: every turn resends its whole history (the model's answers included) with the next "
                       "prompt as the new question, under an x-session-id header of its own, then starts another")
    group.add_argument("--system-prompt-words", type=int, default=0, help="chat: a system prompt of this many words "
                       "that every conversation shares (what a prefix cache can hold for all), before each first turn")
    group.add_argument("--no-stream", action="store_true", help="chat / completions: ask for the whole answer at once")
    group.add_argument("--ignore-eos", default="auto", choices=("auto", "on", "off"),
                       help="send ignore_eos (auto: with the random workload, as vllm bench serve does)")
    group.add_argument("--temperature", type=float, default=None, help="sent when given")


def _arrival_options(group) -> None:
    """How requests arrive: a closed loop of users or open-loop arrivals at a rate, a ramp, and Retry-After honoured."""
    group.add_argument("--arrival", choices=ARRIVALS, default="closed",
                       help="closed: users send again as soon as answered; poisson / gamma: open-loop arrivals at --rate")
    group.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second, all processes together")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma arrivals: shape factor (1 = Poisson, < 1 burstier, > 1 steadier), as vLLM's")
    group.add_argument("--max-in-flight", type=int, default=256,
                       help="open loop: requests in flight at most (all processes); an arrival past it waits")
    group.add_argument("--stages", default="", metavar="SECONDS:VALUE,...",
                       help="a ramp: each stage's length and its users (closed) or rate (open loop)")
    group.add_argument("--honour-retry-after", action="store_true",
                       help="after a 429 / 503 with Retry-After, a closed-loop user waits that long, as the openai SDK does")


def _replay_options(parser) -> None:
    """--scenario replay's group: the trace, how fast and against which models it is replayed."""
    replay = parser.add_argument_group(
        "replay", "--scenario replay: a recorded trace's arrivals and sizes (loadtest/scenarios/replayer.py)")
    replay.add_argument("--trace", default="", help="the trace: the gateway's (trace_dir), Mooncake's or vLLM's timed trace")
    replay.add_argument("--trace-format", default="auto", choices=("auto", "rtxserve", "mooncake", "vllm"),
                        help="auto: the gateway's when its lines have a route, else Mooncake's (timestamps in ms)")
    replay.add_argument("--speed", type=float, default=1.0, help="time runs this many times faster (2: twice the rate)")
    replay.add_argument("--models", default="", metavar="OLD=NEW,...",
                        help="send the trace's requests for OLD to NEW (a candidate model or box)")
    replay.add_argument("--block-tokens", type=int, default=0,
                        help="tokens per hash id (default: 512 for Mooncake's, 16 for vLLM's, read from ours)")
    replay.add_argument("--loop-trace", action="store_true",
                        help="send the trace pass after pass until --duration (each pass new traffic of its shape)")
    replay.add_argument("--calibration", default="", help="set by `rtxserve loadtest replay` from the target's /tokenize "
                        "(JSON: per 'API MODEL', the tokens its template adds and its tokens per word)")
    fit = parser.add_argument_group(
        "fitting a trace to the box", "a public trace made on other hardware, fitted to this one's models "
        "(loadtest/scenarios/fitting.py); each change is counted in the report")
    fit.add_argument("--trace-window", default="", metavar="START:END",
                     help="replay only the requests arriving between these seconds of the trace's own time")
    fit.add_argument("--prompt-scale", type=float, default=1.0, help="multiply every prompt's length")
    fit.add_argument("--prefix-scale", type=float, default=1.0,
                     help="multiply the shared prefixes' length (the tokens each hash id stands for)")
    fit.add_argument("--output-scale", type=float, default=1.0, help="multiply every output's length")
    fit.add_argument("--max-prompt", type=int, default=0, metavar="TOKENS", help="skip the requests whose prompt is longer")
    fit.add_argument("--clamp-prompt", type=int, default=0, metavar="TOKENS", help="cut longer prompts to this")
    fit.add_argument("--max-output", type=int, default=0, metavar="TOKENS", help="cap every output at this")
    fit.add_argument("--max-idle", type=float, default=0.0, metavar="SECONDS",
                     help="no gap between two arrivals longer than this (after --speed)")
    fit.add_argument("--send-anyway", action="store_true", help="send requests longer than their model's context "
                     "(by default the replay stops before sending, with the option that fits them)")


def parse_pairs(text: str, what: str) -> list[tuple[float, float]]:
    """`SECONDS:VALUE,...` as (seconds, value) pairs; every seconds > 0 and value >= 0."""
    pairs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        left, sep, right = item.partition(":")
        try:
            seconds, value = float(left), float(right)
        except ValueError:
            seconds = value = -1.0
        if not sep or seconds <= 0 or value < 0:
            raise ValueError(f"{what}: expected SECONDS:VALUE with seconds > 0 and value >= 0, not {item!r}")
        pairs.append((seconds, value))
    return pairs


def parse_mix(text: str) -> list[tuple[str, str, float]]:
    """`API:MODEL:WEIGHT,...` as (api, model, weight) triples."""
    entries = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        api = parts[0]
        try:
            weight = float(parts[2]) if len(parts) == 3 else -1.0
        except ValueError:
            weight = -1.0
        if len(parts) != 3 or api not in SCENARIOS[:-1] or not parts[1] or weight <= 0:
            raise ValueError(f"--mix: expected API:MODEL:WEIGHT with API one of {', '.join(SCENARIOS[:-1])} "
                             f"and a weight > 0, not {item!r}")
        entries.append((api, parts[1], weight))
    if not entries:
        raise ValueError("--scenario mix needs --mix API:MODEL:WEIGHT,...")
    return entries


def word_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    if not (low.strip().isdigit() and high.strip().isdigit() and 1 <= int(low) <= int(high)):
        raise ValueError(f"--prompt-words must be 'min,max' with 1 <= min <= max, not {text!r}")
    return int(low), int(high)
