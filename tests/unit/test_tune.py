"""`rtxserve tune`: the entry's knobs read and written through Triton's schema, and the quick search."""

import pytest

from rtxserve.tune import Trial, quick_search
from serve.entry_config import Batching, copy_entry, entry_models, read_batching, write_batching

ENSEMBLE = """name: "reviews" platform: "ensemble" max_batch_size: 32
input { name: "TEXT" data_type: TYPE_STRING dims: 1 }
output { name: "LABEL" data_type: TYPE_STRING dims: 1 }
parameters { key: "rtxserve_task" value { string_value: "text-classification" } }
ensemble_scheduling {
  step { model_name: "reviews_tokenizer" model_version: -1 input_map { key: "TEXT" value: "TEXT" } output_map { key: "IDS" value: "ids" } }
  step { model_name: "reviews_model" model_version: -1 input_map { key: "IDS" value: "ids" } output_map { key: "LABEL" value: "LABEL" } }
}"""
STEP = """name: "{name}" backend: "python" max_batch_size: 32
instance_group {{ count: 1 kind: KIND_CPU }}
dynamic_batching {{ max_queue_delay_microseconds: 500 default_queue_policy {{ max_queue_size: 256 }} }}"""


@pytest.fixture
def repository(tmp_path):
    repo = tmp_path / "repo"
    for name, text in (("reviews", ENSEMBLE), ("reviews_tokenizer", STEP.format(name="reviews_tokenizer")),
                       ("reviews_model", STEP.format(name="reviews_model"))):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(text)
    (repo / "reviews_model" / "1" / "model.onnx").write_bytes(b"weights")
    (repo / "other" / "1").mkdir(parents=True)
    return repo


def test_the_knobs_are_read_and_written_on_the_ensemble_and_its_steps(repository):
    assert [m.name for m in entry_models(repository, "reviews")] == ["reviews", "reviews_tokenizer", "reviews_model"]
    assert read_batching(repository, "reviews") == Batching(1, 32, 500)
    write_batching(repository, "reviews", Batching(3, 8, 2000))
    assert read_batching(repository, "reviews") == Batching(3, 8, 2000)
    model = (repository / "reviews_model" / "config.pbtxt").read_text()
    assert "count: 3" in model and "max_batch_size: 8" in model and "max_queue_size: 256" in model  # the rest stays
    assert "max_batch_size: 8" in (repository / "reviews" / "config.pbtxt").read_text()


def test_a_copied_entry_shares_the_weights_but_not_the_configs(repository, tmp_path):
    copy = copy_entry(repository, "reviews", tmp_path / "copy")
    assert sorted(p.name for p in copy.iterdir()) == ["reviews", "reviews_model", "reviews_tokenizer"]
    write_batching(copy, "reviews", Batching(2, 4, 0))
    assert read_batching(repository, "reviews") == Batching(1, 32, 500)  # the original is untouched
    assert (copy / "reviews_model" / "1" / "model.onnx").stat().st_ino == (repository / "reviews_model" / "1" / "model.onnx").stat().st_ino
    copy_entry(repository, "reviews", tmp_path / "copy")  # again, over the earlier copy
    assert read_batching(copy, "reviews") == Batching(1, 32, 500)


def test_an_unknown_entry_is_named_with_the_ones_there(repository):
    with pytest.raises(ValueError, match="no entry 'nope'.*reviews"):
        entry_models(repository, "nope")


def test_quick_search_climbs_to_the_best_neighbour_and_stops_when_none_is_better():
    axes = {"instances": [1, 2, 3], "max_batch_size": [1, 8, 32], "max_queue_delay_us": [0, 500]}
    # goodput peaks at 2 instances, batch 8; batch 32 breaks the SLO
    measured = []

    def measure(config):
        measured.append(config)
        goodput = 100 - 30 * abs(config["instances"] - 2) - 20 * abs([1, 8, 32].index(config["max_batch_size"]) - 1)
        return Trial(config, goodput_rps=goodput, p99_ms=10, eligible=config["max_batch_size"] != 32)

    trials = quick_search(axes, measure, budget=20, log=lambda m: None)
    best = max((t for t in trials if t.eligible), key=lambda t: t.goodput_rps)
    assert best.config["instances"] == 2 and best.config["max_batch_size"] == 8
    assert measured[0] == {"instances": 1, "max_batch_size": 1, "max_queue_delay_us": 0}  # starts at the smallest
    assert len(trials) < 18  # not the whole grid


def test_quick_search_keeps_to_its_budget():
    axes = {"instances": [1, 2, 3, 4], "max_batch_size": [1, 2, 4, 8], "max_queue_delay_us": [0, 1, 2]}
    trials = quick_search(axes, lambda c: Trial(c, goodput_rps=sum(c.values()), eligible=True), 5, log=lambda m: None)
    assert len(trials) == 5


def test_a_search_without_an_slo_or_room_for_a_second_configuration_is_refused_before_any_server_starts():
    from rtxserve.tune import Search

    axes = {"instances": [1, 2]}
    with pytest.raises(ValueError, match="--slo is required"):
        Search("", axes)
    with pytest.raises(ValueError, match="--budget must be at least 2"):
        Search("e2el:100", axes, budget=1)
    assert Search("e2el:100", axes).budget == 8


def test_a_configuration_whose_server_cannot_start_is_named_with_its_log_and_the_search_goes_on(tmp_path):
    import contextlib

    from loadtest.runner import scenario_options
    from rtxserve.tune import Search, tune
    from serve.launcher import ServerStartError

    class Refusing:
        what, scenario = "a server that never starts", "classify"

        def current(self):
            return {"instances": 1, "max_batch_size": 1, "max_queue_delay_us": 0}

        @contextlib.contextmanager
        def serve(self, config, folder):
            raise ServerStartError(f"tritonserver exited with code 1; end of its log:\nE1122 model {config} failed")
            yield

    logged = []
    axes = {"instances": [1, 2], "max_batch_size": [1], "max_queue_delay_us": [0]}
    result = tune(Refusing(), options=scenario_options(model="m"),
                  search=Search("e2el:100", axes, duration_s=4, warmup_s=1, budget=3), out=tmp_path, log=logged.append)
    assert len(result.trials) == 2 and all("end of its log" in t.failure for t in result.trials)
    assert result.best is None and "no configuration met the SLO" in (tmp_path / "tune.md").read_text()
    assert any(m.startswith("config inst 2, batch 1, delay us 0 failed: tritonserver exited") for m in logged)


def test_quick_search_by_capacity_climbs_on_what_each_configuration_held():
    axes = {"instances": [1, 2, 3], "max_batch_size": [1, 8], "max_queue_delay_us": [0]}
    held = {(1, 1): 40.0, (2, 1): 90.0, (3, 1): 70.0, (1, 8): 60.0, (2, 8): 120.0, (3, 8): 80.0}

    def measure(config):  # goodput at the answer's step says nothing here: capacity decides
        rps = held[config["instances"], config["max_batch_size"]]
        return Trial(config, capacity_rps=rps, goodput_rps=1000 - rps, p99_ms=10, eligible=True)

    trials = quick_search(axes, measure, budget=20, log=lambda m: None, by="capacity")
    best = max(trials, key=lambda t: t.figure("capacity"))
    assert best.config == {"instances": 2, "max_batch_size": 8, "max_queue_delay_us": 0}
    assert [t.config["instances"] for t in trials][:2] == [1, 2]


def test_a_capacity_search_that_cannot_run_is_refused_before_any_server_starts():
    from rtxserve.tune import Search

    axes = {"instances": [1, 2]}
    for bad in ({"precision": 1.5}, {"start": 0}, {"max_steps": 1}):
        with pytest.raises(ValueError, match="--precision"):
            Search("e2el:100", axes, **bad)
    Search("e2el:100", axes, measure="goodput", start=0)  # the goodput measure has no search to bound
    with pytest.raises(ValueError, match="--measure: one of capacity, goodput"):
        Search("e2el:100", axes, measure="qps")


def test_tune_by_capacity_recommends_what_held_the_most_and_says_a_missed_first_step_held_nothing(tmp_path, monkeypatch):
    import contextlib

    import loadtest.capacity
    from loadtest.capacity import CapacityResult
    from loadtest.runner import scenario_options
    from rtxserve.tune import Search, tune

    held = {1: None, 2: 48.0, 3: 30.0}  # instances -> requests/s held (None: the first step missed)
    searched = []

    class Entry:
        what, scenario = "a fake entry", "classify"

        def current(self):
            return {"instances": 1, "max_batch_size": 1, "max_queue_delay_us": 0}

        @contextlib.contextmanager
        def serve(self, config, folder):
            self.instances = config["instances"]
            yield "http://127.0.0.1:1", []

        def reproduce(self, config):
            return f"serve it with {config['instances']} instances"

    entry = Entry()

    def fake_search(spec, out, **kwargs):  # the real one needs servers: tests/integration/test_tune.py runs it
        searched.append((spec.options["arrival"], kwargs))
        out.mkdir(parents=True)  # a new folder for every search
        answer = held[entry.instances]
        step = {"load": answer or 4.0, "holds": answer is not None, "why_not": "" if answer else "P99 over the SLO",
                "goodput_rps": 1.0, "qps": 1.0, "p99_ms": 50.0,
                "errors": 0, "requests": 10}
        return CapacityResult([step], answer, None, "the lowest step missed" if answer is None else "held",
                              out / "capacity.md")

    monkeypatch.setattr(loadtest.capacity, "search", fake_search)
    result = tune(entry, options=scenario_options(model="m"), out=tmp_path, log=lambda m: None,
                  search=Search("e2el:100", {"instances": [1, 2, 3], "max_batch_size": [1], "max_queue_delay_us": [0]},
                                start=4, precision=0.25, max_steps=6, budget=3))
    assert [t.capacity_rps for t in result.trials] == [None, 48.0, 30.0]
    assert result.best.config["instances"] == 2 and not result.default.eligible
    assert len(searched) == 4  # the default's first step missed: it was searched once more, the others once
    # the scenario's closed loop became open-loop arrivals; each configuration got the search's bounds, no confirm runs
    assert all(arrival == "poisson" for arrival, _ in searched)
    assert searched[0][1] == {"start": 4, "precision": 0.25, "max_steps": 6, "confirm": False, "log": searched[0][1]["log"]}
    page = (tmp_path / "tune.md").read_text()
    assert "recommended: inst 2, batch 1, delay us 0: 48.0 req/s held within the SLO vs 0.0 for the default" in page
    assert "| inst 1, batch 1, delay us 0 (default) | none | 4.0 | 1 |" in page and "capacity-again/capacity.md" in page
    assert "| inst 2, batch 1, delay us 0 | 48.0 | never | 1 | 50.0 | 0/10 | yes | [report](inst2-batch1-delay0/capacity/capacity.md) |" in page
    assert "To serve with it: `serve it with 2 instances`." in page
