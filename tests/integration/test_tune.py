"""`rtxserve tune` on the real tritonserver and vLLM: each configuration served and loaded for real; measured by
goodput, the recommendation beats the entry's own configuration in the same run, and --apply writes it; measured by
capacity, each configuration gets a real capacity search and the one that held the most is recommended."""

import json

import pytest

from export.encoders.encoder import export_text_classification
from export.triton.entry import EntryOptions
from loadtest.runner import scenario_options
from rtxserve.tune import Search, TritonTarget, tune
from serve.entry_config import Batching, read_batching
from tests.integration import VLLM_EAGER


@pytest.mark.slow(reason="the capacity search's test below climbs the same configurations on Triton and applies its answer")
def test_tune_recommends_a_configuration_that_beats_the_default_and_applies_it(classifier_checkpoint, tmp_path):
    repo = tmp_path / "repo"
    # exported without batching and with one instance: what a first export on a busy box looks like
    export_text_classification(classifier_checkpoint, EntryOptions(name="tunable", max_batch_size=1, max_queue_delay_us=0), repo)
    axes = {"instances": [1, 2], "max_batch_size": [1, 16], "max_queue_delay_us": [0, 2000]}
    target = TritonTarget(repo, "tunable")
    result = tune(target, options=scenario_options(model="tunable"), out=tmp_path / "tune", log=print,
                  search=Search("e2el:2000", axes, measure="goodput", users=16, duration_s=8, warmup_s=2, budget=3,
                                apply=True))
    for t in result.trials:
        print(f"{t.label()}: goodput {t.goodput_rps:.1f}, P99 {t.p99_ms}")
    assert len(result.trials) == 3 and not any(t.failure for t in result.trials)
    assert result.default.config == {"instances": 1, "max_batch_size": 1, "max_queue_delay_us": 0}
    assert result.best is not None and result.best is not result.default
    assert result.best.goodput_rps > result.default.goodput_rps
    assert result.applied and read_batching(repo, "tunable") == Batching(**result.best.config)
    page = (tmp_path / "tune" / "tune.md").read_text()
    assert "recommended:" in page and (tmp_path / "tune" / "tune.png").stat().st_size > 10_000


def test_tune_by_capacity_searches_each_configuration_and_recommends_the_one_that_held_the_most(classifier_checkpoint,
                                                                                                   tmp_path):
    repo = tmp_path / "repo"
    export_text_classification(classifier_checkpoint, EntryOptions(name="tunable", max_batch_size=1, max_queue_delay_us=0), repo)
    axes = {"instances": [1, 2], "max_batch_size": [1], "max_queue_delay_us": [0]}
    result = tune(TritonTarget(repo, "tunable"), options=scenario_options(model="tunable"), out=tmp_path / "tune",
                  log=print, search=Search("e2el:1000", axes, duration_s=6, warmup_s=1, budget=2, start=25,
                                           precision=0.3, max_steps=4, apply=True))
    assert len(result.trials) == 2 and not any(t.failure for t in result.trials)
    for trial in result.trials:
        print(f"{trial.label()}: holds {trial.capacity_rps} req/s in {trial.steps} steps")
        found = json.loads((tmp_path / "tune" / trial.report).with_suffix(".json").read_text())
        held = [s["load"] for s in found["steps"] if s["holds"]]
        missed = [s["load"] for s in found["steps"] if not s["holds"]]
        # open-loop steps from 25 req/s, the answer the most that held, below every rate that missed
        assert found["settings"]["arrival"] == "poisson" and found["steps"][0]["load"] == 25
        assert not any(s["phase"].startswith("confirm") for s in found["steps"])
        assert trial.steps == len(found["steps"]) and trial.capacity_rps == found["answer_rps"]
        if held:
            assert trial.eligible and trial.capacity_rps == max(held) and (not missed or max(held) < min(missed))
        else:  # one instance beside the other test worker can miss 25 req/s already (one CI run: 18 of 22 done)
            assert not trial.eligible and trial.capacity_rps is None and trial.steps == 1
    # two instances held 100 req/s on this AVX2 box beside the other test worker: the best one climbed for real
    assert result.best is max(result.trials, key=lambda t: t.figure("capacity")) and result.best.steps >= 2
    assert read_batching(repo, "tunable") == Batching(**result.best.config)  # --apply wrote it (or it was the default)
    page = (tmp_path / "tune" / "tune.md").read_text()
    assert f"recommended: {result.best.label()}: {result.best.capacity_rps:.1f} req/s held within the SLO" in page


def test_tune_vllm_restarts_the_engine_per_configuration_and_each_engine_schedules_as_configured(llm_fixtures, tmp_path):
    from loadtest.server_metrics import load
    from rtxserve.tune import VLLMTarget
    from serve.vllm_server import VLLMOptions

    target = VLLMTarget(VLLMOptions(model=llm_fixtures / "base", served_name="tiny-llama", max_model_len=512,
                                        extra_args=VLLM_EAGER))
    # Two engines, vLLM's defaults and one sequence at a time: each trial restarts the engine (about 17 s here).
    axes = {"max_num_seqs": [1], "max_num_batched_tokens": [512]}
    options = scenario_options(scenario="chat", model="tiny-llama", output_len=16)
    result = tune(target, options=options, search=Search("e2el:5000", axes, measure="goodput", users=8, duration_s=8,
                                                         warmup_s=2, budget=2),
                  out=tmp_path / "tune", log=print)
    by_seqs = {t.config["max_num_seqs"]: t for t in result.trials}
    assert set(by_seqs) == {None, 1} and not any(t.failure for t in result.trials)
    for t in result.trials:
        print(f"{t.label()}: goodput {t.goodput_rps:.1f}, P99 {t.p99_ms}")
    # Each trial's engine ran with its own flags, as its scheduler's gauges (scraped during the load) show: 8 users
    # run together under vLLM's defaults and queue behind one another under --max-num-seqs 1. Which one has the
    # better goodput is a timing figure (66.1 vs 25.7 req/s measured alone, closer when the cores are shared): the
    # test does not assert it; B4 (BENCHMARKS.md) measures what continuous batching gains over one stream.
    def most(trial, gauge):
        rows = load((tmp_path / "tune" / trial.report).parent / "server_metrics.csv")
        return max(r.value for r in rows if r.metric == f"vllm:num_requests_{gauge}")

    assert most(by_seqs[1], "running") == 1 and most(by_seqs[1], "waiting") >= 4
    assert most(by_seqs[None], "running") >= 4
    assert result.best is not None
    page = (tmp_path / "tune" / "tune.md").read_text()  # both trials, and how to serve the one it recommends
    assert all(f"| {t.label()}" in page for t in result.trials)
    assert f"To serve with it: `{target.reproduce(result.best.config)}`." in page
