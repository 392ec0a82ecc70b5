"""B7's report on canned figures (the real run is `rtxserve bench detection`)."""

from bench.detection import FORMS, markdown, plot


def test_report_gives_speedups_sizes_and_the_map_each_form_keeps(tmp_path):
    ms = {"pytorch eager": 270.0, "onnxruntime fp32": 120.0, "onnxruntime int8": 68.0}
    result = {"model": "yolo11s.yaml (random weights), 640x640, batch 1", "threads": 2, "rounds": 2,
              "iterations_per_round": 3, "median_ms": ms, "per_round_ms": {f: [v - 1, v + 1] for f, v in ms.items()},
              "speedup_vs_eager": {f: 270.0 / v for f, v in ms.items()},
              "size_bytes": {"pytorch eager": 19e6, "onnxruntime fp32": 38e6, "onnxruntime int8": 10e6},
              "accuracy_model": "fixture YOLO11n at 128, 16 generated validation images",
              "accuracy": {f: {"map50": m, "map50_95": m / 2} for f, m in zip(FORMS, (0.9, 0.9, 0.88))},
              "map50_drop_int8": 0.02, "targets": {}, "versions": {"onnxruntime": "1.32.0"}}
    text = markdown(result)
    assert "| onnxruntime int8 | 68.0 | 3.97x | 10.0 | 0.8800 | 0.4400 |" in text
    assert "mAP@0.5 drop at int8: +0.0200" in text
    assert plot(result, tmp_path / "b7.png").stat().st_size > 10_000
