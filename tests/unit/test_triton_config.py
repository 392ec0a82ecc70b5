import json

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from export.triton.model_config import DynamicBatching, EnsembleStep, InstanceGroup, ModelConfig, TensorSpec
from export.triton.entry import EntryOptions, classification_entry


def _entry(tmp_path, **opts):
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"onnx")
    return classification_entry(
        EntryOptions(name="clf", **opts), onnx_path=onnx, tokenizer_json="{}",
        input_names=["input_ids", "attention_mask", "token_type_ids"], labels=["neg", "pos"], max_length=64,
        pad_token_id=0, problem_type=None, metadata={"task": "text-classification"}, parity={"passed": True},
    )


def _parse(config: ModelConfig) -> model_config_pb2.ModelConfig:
    return text_format.Parse(config.to_pbtxt(), model_config_pb2.ModelConfig())


def test_cpu_entry_is_an_ensemble_of_python_models_with_batching_and_instances(tmp_path):
    models = _entry(tmp_path, instances=3, max_batch_size=16, max_queue_delay_us=200)
    ensemble, tokenizer, model, post = (_parse(m.config) for m in models)
    assert ensemble.platform == "ensemble" and ensemble.max_batch_size == 16
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["clf_tokenizer", "clf_model", "clf_postprocess"]
    assert json.loads(ensemble.parameters["rtxserve_labels"].string_value) == ["neg", "pos"]
    assert ensemble.parameters["rtxserve_task"].string_value == "text-classification"
    assert model.backend == "python"
    assert model.instance_group[0].count == 3
    assert model.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert model.dynamic_batching.max_queue_delay_microseconds == 200
    policy = model.dynamic_batching.default_queue_policy  # Triton sheds instead of queueing without end
    assert policy.max_queue_size == 256 and policy.default_timeout_microseconds == 30_000_000
    assert policy.timeout_action == model_config_pb2.ModelQueuePolicy.REJECT
    assert [i.name for i in model.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert list(model.output[0].dims) == [2]
    assert tokenizer.parameters["padding"].string_value == "longest"
    assert tokenizer.input[0].data_type == model_config_pb2.TYPE_STRING
    assert [o.name for o in post.output] == ["PROBS", "LABEL", "SCORE"]
    assert "1/model.py" in models[2].files and "1/model.onnx" in models[2].files


def test_gpu_entry_uses_native_onnxruntime_on_gpu_instances_with_fixed_padding(tmp_path):
    models = _entry(tmp_path, target="gpu", instances=2, gpus=(0, 1))
    tokenizer, model = _parse(models[1].config), _parse(models[2].config)
    assert model.platform == "onnxruntime_onnx" and not model.backend
    assert model.default_model_filename == "model.onnx"
    group = model.instance_group[0]
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU and group.count == 2 and list(group.gpus) == [0, 1]
    assert "1/model.py" not in models[2].files
    assert tokenizer.parameters["padding"].string_value == "max_length"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="bad name"), "invalid model name"),
        (dict(name="m", target="tpu"), "unknown target"),
        (dict(name="m", instances=0), "--instances"),
        (dict(name="m", max_batch_size=0), "--max-batch-size"),
        (dict(name="m", gpus=(0,)), "--gpus only applies"),
    ],
)
def test_entry_options_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EntryOptions(**kwargs)


def test_config_rejects_unknown_data_type_and_miswired_ensembles():
    with pytest.raises(ValueError, match="unknown data type"):
        TensorSpec("x", "TYPE_FLOAT", (1,))
    text = TensorSpec("TEXT", "TYPE_STRING", (1,))
    out = TensorSpec("OUT", "TYPE_FP32", (1,))
    with pytest.raises(ValueError, match="reads .*MISSING"):
        ModelConfig(name="e", platform="ensemble", max_batch_size=1, inputs=(text,), outputs=(out,),
                    ensemble_steps=(EnsembleStep("m", {"x": "MISSING"}, {"y": "OUT"}),))
    with pytest.raises(ValueError, match="no step produces"):
        ModelConfig(name="e", platform="ensemble", max_batch_size=1, inputs=(text,), outputs=(out,),
                    ensemble_steps=(EnsembleStep("m", {"x": "TEXT"}, {"y": "OTHER"}),))
    with pytest.raises(ValueError, match="no instance groups"):
        ModelConfig(name="e", platform="ensemble", max_batch_size=1, inputs=(text,), outputs=(out,),
                    instance_groups=(InstanceGroup(),), ensemble_steps=(EnsembleStep("m", {"x": "TEXT"}, {"y": "OUT"}),))


def test_dynamic_batching_queue_policy_renders():
    config = ModelConfig(name="m", backend="python", max_batch_size=8, inputs=(TensorSpec("a", "TYPE_FP32", (4,)),),
                         outputs=(TensorSpec("b", "TYPE_FP32", (4,)),),
                         dynamic_batching=DynamicBatching(100, (4, 8), max_queue_size=64))
    parsed = _parse(config)
    assert list(parsed.dynamic_batching.preferred_batch_size) == [4, 8]
    assert parsed.dynamic_batching.default_queue_policy.max_queue_size == 64


def test_ragged_inputs_let_the_batcher_group_texts_of_different_lengths():
    from export.triton.model_config import ModelConfig, TensorSpec

    config = ModelConfig(name="m_model", backend="python", max_batch_size=8,
                         inputs=(TensorSpec("input_ids", "TYPE_INT64", (-1,), allow_ragged_batch=True),),
                         outputs=(TensorSpec("logits", "TYPE_FP32", (2,)),))
    text = config.to_pbtxt()
    assert "allow_ragged_batch: true" in text and text.count("allow_ragged_batch") == 1
