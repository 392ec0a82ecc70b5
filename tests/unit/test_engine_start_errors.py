"""What a client reads when an engine cannot start (R15: no traceback, no file path in a 4xx/5xx body), and what the
operator's log keeps: serve/launcher.start_cause on vLLM 0.32's own log of a refused max_model_len, and the control
server's answer to a wake-up that failed."""

from starlette.testclient import TestClient

from serve.engine_control import app
from serve.launcher import ServerStartError, start_cause

# the end of `vllm serve <a model of 512 positions> --max-model-len 1024`'s log (vLLM 0.32, CPU), as it wrote it
VLLM_REFUSED = '''(APIServer pid=9979) INFO 11-28 13:46:55 [utils.py:233] non-default args: {'max_model_len': 1024}
Traceback (most recent call last):
  File "/srv/box/.envs/vllm/bin/vllm", line 10, in <module>
    sys.exit(main())
  File "/srv/box/.envs/vllm/lib/python3.11/site-packages/vllm/engine/arg_utils.py", line 1955, in create_model_config
    return ModelConfig(
           ^^^^^^^^^^^^
  File "/srv/box/.envs/vllm/lib/python3.11/site-packages/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (1024) is greater than the derived max_model_len (max_position_embeddings=512.0 or model_max_length=None in model's config.json). To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative position encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses absolute position encoding, positions exceeding derived_max_model_len will cause a CUDA array out-of-bounds error. [type=value_error, input_value=ArgsKwargs((), {'model': '/srv/box/models/llm'}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
'''


def test_the_cause_is_the_last_exception_with_its_detail_in_whole_sentences_and_no_path(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text(VLLM_REFUSED)
    cause = start_cause(log)
    assert cause.startswith("ValidationError: 1 validation error for ModelConfig: Value error, User-specified "
                            "max_model_len (1024) is greater than the derived max_model_len (max_position_embeddings=512")
    assert cause.endswith("must be used with extreme caution.") and len(cause) <= 400
    assert "/srv" not in cause and "File " not in cause and "[type=" not in cause
    log.write_text("(EngineCore_DP0 pid=12) OSError: /srv/box/models/llm/model.safetensors is not a file\n")
    assert start_cause(log) == "OSError: model.safetensors is not a file"
    log.write_text("INFO nothing raised\n")
    assert start_cause(log) == "" and start_cause(tmp_path / "missing.log") == ""


class _Failing:
    sleeping = True

    async def wake_up(self):
        raise ServerStartError("vllm exited with code 1 before it was ready; end of /srv/box/logs/engine.log:\n"
                               + VLLM_REFUSED, "OSError: model.safetensors is not a file")

    async def sleep(self):
        pass


def test_a_failed_wake_up_answers_the_cause_and_logs_the_tail(caplog):
    with TestClient(app(_Failing())) as client:
        answer = client.post("/wake_up")
    assert answer.status_code == 500
    assert answer.json() == {"error": {"message": "the engine did not start: OSError: model.safetensors is not a file"}}
    assert "Traceback" in caplog.text and "/srv/box/logs/engine.log" in caplog.text  # the operator's log has it all
