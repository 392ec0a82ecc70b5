"""`rtxserve tune triton` on the real tritonserver: each configuration served and loaded for real; the
recommendation beats the entry's own configuration in goodput, in the same run, and --apply writes it."""

from export.encoder import export_text_classification
from export.triton_entry import EntryOptions
from rtxserve.tune import tune_triton
from serve.entry_config import Batching, read_batching


def test_tune_recommends_a_configuration_that_beats_the_default_and_applies_it(classifier_checkpoint, tmp_path):
    repo = tmp_path / "repo"
    # exported without batching and with one instance: what a first export on a busy box looks like
    export_text_classification(classifier_checkpoint, EntryOptions(name="tunable", max_batch_size=1, max_queue_delay_us=0), repo)
    axes = {"instances": [1, 2], "max_batch_size": [1, 16], "max_queue_delay_us": [0, 2000]}
    result = tune_triton(repo, "tunable", slo="e2el:2000", axes=axes, users=16, duration_s=8, warmup_s=2, budget=4,
                         apply=True, out=tmp_path / "tune", log=print)
    for t in result.trials:
        print(f"{t.label()}: goodput {t.goodput_rps:.1f}, P99 {t.p99_ms}")
    assert len(result.trials) == 4 and not any(t.failure for t in result.trials)
    assert result.default.config == {"instances": 1, "max_batch_size": 1, "max_queue_delay_us": 0}
    assert result.best is not None and result.best is not result.default
    assert result.best.goodput_rps > result.default.goodput_rps
    assert result.applied and read_batching(repo, "tunable") == Batching(**result.best.config)
    page = (tmp_path / "tune" / "tune.md").read_text()
    assert "recommended:" in page and (tmp_path / "tune" / "tune.png").stat().st_size > 10_000
