"""B12's page on canned figures (the real run is `rtxserve bench swap`: serve up of a CPU box, locust, a few minutes)."""

from bench.swap import CLASSIFIERS, VARIANTS, _zipf, markdown


def test_the_page_has_each_models_row_and_the_share_that_waited():
    result = {"machine": "a CPU", "swap_room_gib": 4.3, "rate": 1.0, "duration_s": 120.0, "requests": 10, "errors": 1,
              "error_kinds": {"HTTP 503": 1}, "waited_share": 0.5,
              "by_model": {"reviews-1": {"p50_ms": 1500.0, "p99_ms": 9000.0, "requests": 6}},
              "gateway": {"reviews-1": {"waited": 3.0, "loads": 2.0, "unloads": 1.0, "load_mean_s": 2.5,
                                        "unload_mean_s": 0.02}}}
    text = markdown(result)
    assert "| reviews-1 | 6 | 1500 | 9000 | 3 | 2 | 1 | 2.50 | 0.02 |" in text
    assert "| chat-b | 0 | nan | nan | 0 | 0 | 0 | - | - |" in text  # asked for by nobody: said so, not left out
    assert "**50.0% of them waited for a load**" in text and "10 requests, 1 errors (HTTP 503: 1)" in text


def test_each_set_of_models_is_asked_for_with_zipf_weights_summing_to_its_share():
    entries = [e.split(":") for e in _zipf(CLASSIFIERS, "classify", 0.75) + _zipf(VARIANTS, "chat", 0.25)]
    weights = {model: float(w) for _, model, w in entries}
    assert abs(sum(weights[m] for m in CLASSIFIERS) - 0.75) < 1e-3 and abs(sum(weights[m] for m in VARIANTS) - 0.25) < 1e-3
    assert abs(weights["reviews-1"] / weights["reviews-2"] - 2) < 1e-2  # the k-th: 1/k of the first
