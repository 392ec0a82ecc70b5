"""The task registry is what export, the gateway and the load tests read: every task it declares has a
builder in export, its routes in the gateway's app and its scenarios in the load tester."""

from core import tasks


def test_every_task_is_served_built_and_load_tested():
    from export.encoders.task_specs import ENCODER_TASKS
    from loadtest.scenarios.options import SCENARIOS
    from serve.gateway.app import create_app
    from serve.gateway.settings import GatewaySettings

    routes = set(create_app(GatewaySettings(triton_grpc_url="", vllm_url="")).openapi()["paths"])
    for task in tasks.TASKS.values():
        assert set(task.routes) <= routes, task.name
        assert set(task.loadtest) <= set(SCENARIOS) and len(task.loadtest) == len(task.routes), task.name
    assert set(tasks.of_kind("encoder")) == set(ENCODER_TASKS)  # every encoder task has its export builder, and no more


def test_scenarios_call_their_tasks_routes():
    from loadtest.scenarios import apis

    assert apis.ENCODER_APIS == {"classify": "/v1/classify", "ner": "/v1/ner", "embeddings": "/v1/embeddings",
                                 "image": "/v1/classify", "detect": "/v1/detect"}
    assert apis.GENERATION_APIS == {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
    assert apis.RANK_APIS == {"rerank": "/v1/rerank", "score": "/v1/score"}
    assert apis.IMAGES_API == "/v1/images/generations"
