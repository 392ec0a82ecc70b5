"""export/activations.py: an image graph's activations, as onnx-tool lays its live tensors out, split into what each
image adds and what is fixed."""

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.activations import graph_activations, peak_bytes


def _conv_graph(path, channels: int = 8):
    weights = numpy_helper.from_array(np.ones((channels, 3, 3, 3), np.float32), "w")
    nodes = [helper.make_node("Conv", ["pixels", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["n", 3, 32, 32])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", channels, 1, 1])], [weights])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_the_split_predicts_a_larger_batch_and_counts_each_images_tensors(tmp_path):
    path = _conv_graph(tmp_path / "m.onnx")
    graph = graph_activations(path, "pixels", (3, 32, 32))
    assert graph["item_shape"] == [3, 32, 32]
    assert graph["fixed_bytes"] + 4 * graph["per_item_bytes"] == peak_bytes(path, {"pixels": (4, 3, 32, 32)})
    # the image's pixels and its 8-channel convolution output are live together, at least
    assert graph["per_item_bytes"] >= (3 + 8) * 32 * 32 * 4


def test_a_graph_onnx_tool_cannot_follow_gives_none_and_a_warning(tmp_path, caplog):
    (tmp_path / "m.onnx").write_bytes(b"not a graph")
    with caplog.at_level(logging.WARNING):
        assert graph_activations(tmp_path / "m.onnx", "pixels", (3, 32, 32)) is None
    assert "could not size the graph's activations" in caplog.text
