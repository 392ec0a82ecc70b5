"""What every trained fixture shares: training in rounds until the property the tests read from it holds with a
margin, and saving as a fine-tune is saved.

A fixture is trained on the machine that runs the tests, and float kernels differ from one CPU to the next (AMX,
AVX-512, AVX2), so what a given number of steps learns differs too. Each trained fixture therefore names the
property that tests rely on (a `Property`: the probes it must answer, with a margin larger than any difference
between the framework and a served engine), and `train_until` trains in rounds until it holds, or stops the build
with a `FixtureError` that names what it did not learn. A test reads only what the build checked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

# The lead in probability a classifier's probe answer must have over the runner-up: far beyond the differences between
# the framework and a served engine (1e-4 and under), and one the fixtures reach in a round or two.
PROBABILITY_MARGIN = 0.2


class FixtureError(RuntimeError):
    """A fixture that did not learn what the tests read from it, or that cannot be built here."""


@dataclass(frozen=True)
class Property:
    """What a fixture must answer. `shortfalls(model)` (the model in eval mode, gradients off) lists each probe it
    gets wrong or without the margin, one line each; none means the property holds."""

    what: str
    shortfalls: Callable[[object], list[str]]

    def check(self, model) -> list[str]:
        import torch

        model.eval()
        with torch.no_grad():
            return self.shortfalls(model)


def train_until(model, batch_loss, prop: Property | None, *, name: str, steps: int, lr: float, rounds: int) -> None:
    """Train `model` with AdamW on `batch_loss()` (a fresh batch's loss each call) in rounds of `steps`, until `prop`
    holds (eval mode after); after `rounds` rounds without it, raise FixtureError naming what is missing. With no
    `prop` (a model that no test reads a prediction of), one round and no check."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for done in range(1, rounds + 1):
        model.train()
        for _ in range(steps):
            loss = batch_loss()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if prop is None:
            model.eval()
            return
        missing = prop.check(model)
        if not missing:
            log.info("the %s fixture %s after %d steps (final loss %.3f)", name, prop.what, done * steps, loss.item())
            return
        log.info("the %s fixture after %d steps does not yet: %s", name, done * steps, missing[0])
    raise FixtureError(failure(name, prop.what, rounds * steps, "steps", missing))


def failure(name: str, what: str, trained: int, unit: str, missing: list[str]) -> str:
    """The message of a fixture whose build stops: what it should have learnt, how long it trained, what it got wrong."""
    shown = "; ".join(missing[:4]) + (f"; and {len(missing) - 4} more" if len(missing) > 4 else "")
    return (f"the {name} fixture did not learn that it {what} in {trained} {unit} of training on this machine: "
            f"{shown}. Its tests read that property; train it for longer (more rounds) or look at what changed")


def margin_shortfall(probe: str, probs, want: int, labels: list[str], margin: float) -> str | None:
    """A probe whose probabilities `probs` (one row) do not put label `want` first by at least `margin`: why, or None."""
    ranked = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    runner_up = ranked[1] if ranked[0] == want else ranked[0]
    gap = float(probs[want]) - float(probs[runner_up])
    if gap >= margin:
        return None
    return (f"{probe!r}: {labels[want]} {float(probs[want]):.3f} vs {labels[runner_up]} {float(probs[runner_up]):.3f} "
            f"(needs a lead of {margin})")


def save(out: Path, model, processor, readme: str) -> Path:
    """save_pretrained the model and its tokenizer / image processor, as a fine-tune would be saved."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "README.md").write_text(readme)
    return out
