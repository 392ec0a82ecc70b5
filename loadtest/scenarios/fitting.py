"""A trace fitted to the box that replays it (`rtxserve loadtest replay TRACE --trace-window ... --prompt-scale ...`).

A public trace was recorded on other hardware with other models: Mooncake's conversation trace has prompts of 6.9k
tokens at the median and up to 120k, which a small box's 8k (or 512-token) context refuses. As AIPerf's fixed-schedule
offsets and synthesis options do, a replay may take a window of the trace (in its own time), scale its prompt, shared
prefix and output lengths, skip or clamp the prompts over a maximum, cap the outputs and the idle gaps, each change
counted in the report. Before anything is sent, the fitted trace is checked against each target model's context
(`max_model_len` in the target's /v1/models): requests the model must refuse stop the replay with the numbers and the
option that fits them (`--send-anyway` sends them regardless). `--analyze` says what a trace holds without sending.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import numpy as np

from core.tasks import TEXT_GENERATION, routes_by_scenario

GENERATION = set(routes_by_scenario(tasks=(TEXT_GENERATION,)))


def parse_window(text: str) -> tuple[float, float | None]:
    """`--trace-window START:END` in seconds of the trace's own time (either side may be left out)."""
    if not text:
        return 0.0, None
    left, sep, right = text.partition(":")
    try:
        start, end = float(left or 0), (float(right) if right else None)
    except ValueError:
        start, end, sep = -1.0, None, ""
    if not sep or start < 0 or (end is not None and end <= start):
        raise ValueError(f"--trace-window: expected START:END in seconds of the trace, 0 <= START < END, not {text!r}")
    return start, end


@dataclass(frozen=True)
class Fit:
    """How a trace is fitted (every field at its default: as recorded)."""

    start_s: float = 0.0
    end_s: float | None = None
    prompt_scale: float = 1.0
    prefix_scale: float = 1.0
    output_scale: float = 1.0
    max_prompt: int = 0  # skip a generation request whose (scaled) prompt is longer; 0: none skipped
    clamp_prompt: int = 0  # cut a longer (scaled) prompt to this; 0: none cut
    max_output: int = 0  # cap the (scaled) output; 0: as recorded
    max_idle_s: float = 0.0  # no gap between two arrivals longer than this (after --speed); 0: as recorded

    @classmethod
    def from_options(cls, options) -> "Fit":
        start, end = parse_window(getattr(options, "trace_window", ""))
        fit = cls(start, end, *(getattr(options, name, default) for name, default in (
            ("prompt_scale", 1.0), ("prefix_scale", 1.0), ("output_scale", 1.0), ("max_prompt", 0),
            ("clamp_prompt", 0), ("max_output", 0), ("max_idle", 0.0))))
        fit.check()
        return fit

    def check(self) -> None:
        for option, value in (("--prompt-scale", self.prompt_scale), ("--prefix-scale", self.prefix_scale),
                              ("--output-scale", self.output_scale)):
            if not value > 0:
                raise ValueError(f"{option} must be > 0 (a length multiplier), not {value:g}")
        for option, value in (("--max-prompt", self.max_prompt), ("--clamp-prompt", self.clamp_prompt),
                              ("--max-output", self.max_output), ("--max-idle", self.max_idle_s)):
            if value < 0:
                raise ValueError(f"{option} must be >= 0 (0: none), not {value:g}")

    def apply(self, requests: list, speed: float, skipped: Counter, fitted: Counter) -> list:
        """`requests` (replayer.Request, times in seconds after the trace's first) in the window, sized and timed;
        why a request was left out counts in `skipped`, each change in `fitted`. Raises ValueError naming the option
        that leaves nothing."""
        span = requests[-1].at if requests else 0.0
        inside = [r for r in requests if self.start_s <= r.at and (self.end_s is None or r.at < self.end_s)]
        if not inside:
            raise ValueError(f"--trace-window {self.start_s:g}:{'' if self.end_s is None else f'{self.end_s:g}'} holds "
                             f"no request: the trace runs from 0 to {span:.1f} s")
        if len(inside) < len(requests):
            fitted[f"left out of the window {self.start_s:g} to "
                   f"{'the end' if self.end_s is None else f'{self.end_s:g}'} s"] += len(requests) - len(inside)
        sized = [s for s in (self._sized(r, skipped, fitted) for r in inside) if s is not None]
        if not sized:
            smallest = min(max(1, round(r.input_tokens * self.prompt_scale)) for r in inside)
            raise ValueError(f"--max-prompt {self.max_prompt} is below every prompt in the window (the smallest: "
                             f"{smallest} tokens)")
        out, previous, clock = [], None, 0.0
        for request in sized:  # times from the window's start, at `speed`; the idle gaps cut
            at = (request.at - self.start_s) / speed
            gap = at if previous is None else at - previous
            if self.max_idle_s and previous is not None and gap > self.max_idle_s:
                fitted[f"idle gaps cut to {self.max_idle_s:g} s"] += 1
                gap = self.max_idle_s
            previous, clock = at, clock + gap
            out.append(dataclasses.replace(request, at=clock))
        return out

    def _sized(self, request, skipped: Counter, fitted: Counter):
        if request.api not in GENERATION:
            return request
        prompt = max(1, round(request.input_tokens * self.prompt_scale))
        output = max(1, round(request.output_tokens * self.output_scale))
        if self.max_prompt and prompt > self.max_prompt:
            skipped[f"longer than --max-prompt {self.max_prompt} tokens"] += 1
            return None
        for what, scale in (("prompts", self.prompt_scale), ("outputs", self.output_scale)):
            if scale != 1:
                fitted[f"{what} scaled {scale:g}x"] += 1
        if self.clamp_prompt and prompt > self.clamp_prompt:
            fitted[f"prompts clamped to {self.clamp_prompt} tokens"] += 1
            prompt = self.clamp_prompt
        if self.max_output and output > self.max_output:
            fitted[f"outputs capped at {self.max_output} tokens"] += 1
            output = self.max_output
        return dataclasses.replace(request, input_tokens=prompt, output_tokens=output)

    def block_tokens(self, recorded: int) -> int:
        """Tokens each hash id stands for: the shared prefixes `prefix_scale` times as long."""
        return max(1, round(recorded * self.prefix_scale))


def _p(values, q: float) -> int:
    return int(round(float(np.percentile(values, q)))) if len(values) else 0


def over_context(trace, contexts: dict[str, int]) -> str | None:
    """Why the trace (replayer.Trace) cannot be sent as it stands: its generation requests whose prompt and output
    pass their model's context (`contexts`: model -> max_model_len), with the options that fit them; None when all
    fit."""
    over = [r for r in trace.requests if r.api in GENERATION and r.model in contexts
            and r.input_tokens + r.output_tokens > contexts[r.model]]
    if not over:
        return None
    model = Counter(r.model for r in over).most_common(1)[0][0]
    context = contexts[model]
    mine = [r for r in trace.requests if r.model == model and r.api in GENERATION]
    totals = [r.input_tokens + r.output_tokens for r in mine]
    longest_output = max(r.output_tokens for r in mine)
    room = context - longest_output
    fits = sum(r.input_tokens <= room for r in mine) if room > 0 else 0
    cap = "" if room >= context // 2 else f"--max-output {context // 4} with "
    clamp = room if room >= context // 2 else context - context // 4
    scale = context * 0.9 / max(totals)
    skip = f"--max-prompt {clamp} (skip them: {fits} of {len(mine)} would be sent), " if fits and not cap else ""
    return (f"{len(over)} of {len(trace.requests)} requests need more than their model's context ({model}: "
            f"{context} tokens; prompt + output P50 {_p(totals, 50)}, P99 {_p(totals, 99)}, max {max(totals)}): the "
            f"model would refuse them. Fit the trace: {cap}--clamp-prompt {clamp} (cut the longer prompts), {skip}"
            f"or --prompt-scale {scale:.3g} (every prompt shorter); or --send-anyway to send them as they are")


def analyze(trace, contexts: dict[str, int] | None) -> str:
    """What a trace (replayer.Trace) holds, without sending it: requests, span, rate, prompt and output lengths, the
    prefix blocks seen before, and, with the target's `contexts`, how many requests fit each model."""
    generation = [r for r in trace.requests if r.api in GENERATION]
    span = trace.duration_s
    lines = [f"trace: {trace.format}, {len(trace.requests)} requests over {span:.1f} s "
             f"({len(trace.requests) / span if span else float('nan'):.2f}/s), "
             f"models: {', '.join(trace.models())}"]
    if generation:
        prompts, outputs = [r.input_tokens for r in generation], [r.output_tokens for r in generation]
        lines += [f"prompt tokens: P50 {_p(prompts, 50)}, P90 {_p(prompts, 90)}, P99 {_p(prompts, 99)}, "
                  f"max {max(prompts)}",
                  f"output tokens: P50 {_p(outputs, 50)}, P90 {_p(outputs, 90)}, P99 {_p(outputs, 99)}, "
                  f"max {max(outputs)}"]
        seen, before, blocks = set(), 0, 0
        for r in generation:
            blocks += len(r.hash_ids)
            before += sum(h in seen for h in r.hash_ids)
            seen.update(r.hash_ids)
        if blocks:
            lines.append(f"prefix blocks seen before: {before / blocks:.0%} of {blocks} ({trace.block_tokens} tokens "
                         "each): the most a prefix cache could hit")
    for model in trace.models():
        mine = [r for r in generation if r.model == model]
        if not mine:
            continue
        if contexts and model in contexts:
            fits = sum(r.input_tokens + r.output_tokens <= contexts[model] for r in mine)
            lines.append(f"fits {model} ({contexts[model]}-token context): {fits} of {len(mine)} requests")
        else:
            lines.append(f"fits {model}: not known (no context for it at the target: pass --host, or --models OLD=NEW)")
    lines += [f"fitted: {n} {why}" for why, n in trace.fitted.most_common()]
    lines += [f"skipped: {n} {why}" for why, n in trace.skipped.most_common()]
    return "\n".join(lines)
