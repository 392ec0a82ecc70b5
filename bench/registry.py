"""Every benchmark's record (bench/record.py), in BENCH.md's order: `rtxserve bench` (bench/cli.py) makes a
sub-command of each and `make bench` (bench/all.py) runs those it takes into BENCHMARKS.md, in this order. Adding a
benchmark is its module, with its `BENCHMARK` at the foot, and one line here."""

from __future__ import annotations

from . import (accuracy, affinity, batching, cache, detection, export, gateway, llm, priority, promotion, quantize,
               reliability, replay, soak, speech, swap)
from .record import Benchmark

BENCHMARKS: tuple[Benchmark, ...] = (
    gateway.BENCHMARK,  # B1 (and B1s)
    export.BENCHMARK,  # B2
    batching.BENCHMARK,  # B3 / B5
    llm.BENCHMARK,  # B4 (G2, G3 on a GPU)
    accuracy.BENCHMARK,  # B6
    detection.BENCHMARK,  # B7
    quantize.BENCHMARK,  # B8
    cache.BENCHMARK,  # B9
    affinity.BENCHMARK,  # B10
    speech.BENCHMARK,  # B11
    swap.BENCHMARK,  # B12
    replay.BENCHMARK,  # B13
    priority.BENCHMARK,  # B14
    promotion.BENCHMARK,  # B15
    reliability.BENCHMARK,  # R3 / R14 (R2, R1)
    soak.BENCHMARK,  # R18
)
BY_NAME = {b.name: b for b in BENCHMARKS}
if len(BY_NAME) != len(BENCHMARKS):
    raise ValueError("two benchmarks share a name")
