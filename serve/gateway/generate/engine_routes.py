"""The routes a vLLM engine serves that the gateway does not relay, each with its reason.

Every other route in an engine's `/openapi.json` is relayed through the front door, with the same keys, scope,
bounds and usage as its siblings. tests/integration compares each engine kind's document (a chat engine, a pooling
engine, a Whisper) with the gateway: a route vLLM adds fails the test until it is relayed or written here.
"""

# The gateway answers these itself, for the whole box.
OWN = {
    "/health": "the gateway's own liveness (its /healthz and /readyz say more)",
    "/metrics": "the gateway's own metrics; each engine's are scraped on its own port",
    "/v1/models": "every model of the box, from every backend, the key's scope applied",
}

# Not reachable through the gateway (404), on purpose.
REFUSED = {
    "/ping": "SageMaker's probe; the gateway's /healthz and /readyz are the probes here",
    "/invocations": "SageMaker's single entry point, dispatching on the body's shape; clients call the routes it "
                    "dispatches to, each bounded here",
    "/load": "an engine's requests in flight, for a load balancer in front of engines; the gateway balances itself",
    "/version": "the engine's version is the operator's business, on the engine's own port",
    "/server_info": "engine configuration, for operators on the engine's own port",
    "/tokenizer_info": "engine configuration, for operators on the engine's own port",
    "/is_scaling_elastic_ep": "engine administration (expert parallelism), on the engine's own port",
    "/scale_elastic_ep": "engine administration (expert parallelism), on the engine's own port",
    "/kv_event_sources": "engine administration (KV-cache events), on the engine's own port",
    "/v1/load_lora_adapter": "adapters are added through the gateway's /admin/adapters (`rtxserve adapters add`), "
                             "which checks the adapter against its base and needs an admin key",
    "/v1/unload_lora_adapter": "through the gateway's /admin/adapters (`rtxserve adapters remove`), with an admin key",
    "/adapters": "SageMaker's adapter routes (vLLM mounts them with runtime LoRA on); adapters go through the "
                 "gateway's /admin/adapters, with an admin key",
    "/adapters/{adapter_name}": "SageMaker's adapter routes, as /adapters",
    "/v1/responses/{response_id}": "vLLM keeps a response only when started to store them, each engine its own; the "
                                   "gateway's /v1/responses is stateless (no previous_response_id)",
    "/v1/responses/{response_id}/cancel": "as /v1/responses/{response_id}: nothing is stored to cancel",
    "/v1/chat/completions/batch": "several chats in one request, with no bound per chat here yet; send them one by one, "
                                  "or as a batch (/v1/batches)",
    "/generative_scoring": "not bounded here yet (its inputs and the tokens it scores); refused rather than relayed "
                           "unbounded",
    "/v1/systemone": "vLLM's structured-decisions API, not bounded here yet; refused rather than relayed unbounded",
}
