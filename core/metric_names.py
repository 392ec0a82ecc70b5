"""The gateway's Prometheus metric names, declared once: the gateway exports them (serve/gateway/metrics.py), the
rendered dashboards and alerts query them (deploy/monitoring.py) and the load tester scrapes them
(loadtest/server_metrics.py)."""

REQUEST_SECONDS = "rtxserve_request_duration_seconds"  # histogram, by route, model, status
REQUESTS = "rtxserve_requests_total"  # counter, by route, model, status
TOKENS = "rtxserve_tokens_total"  # counter, by model, kind
IN_FLIGHT = "rtxserve_requests_in_flight"  # gauge
QUEUED = "rtxserve_requests_queued"  # gauge
SHED = "rtxserve_requests_shed_total"  # counter, by reason
# Admission by priority (a key's: interactive 0, batch 10, lower first)
PRIORITY_QUEUED = "rtxserve_priority_queued"  # gauge, by priority: requests waiting for a slot
PRIORITY_WAIT = "rtxserve_priority_wait_seconds"  # histogram, by priority: how long each waited (0 for none)
PRIORITY_SHED = "rtxserve_priority_shed_total"  # counter, by priority: refused by admission control
BACKEND_SECONDS = "rtxserve_backend_request_duration_seconds"  # histogram, by backend
# histogram, by route: the gateway's own time per request (its time minus its backend calls', to the response's start)
OVERHEAD_SECONDS = "rtxserve_gateway_overhead_seconds"
OVERHEAD_HEADER = "x-rtxserve-overhead-ms"  # the same figure on every response, in milliseconds
# histogram, by model: the requests each Triton call carried (classify, embeddings and NER batches are coalesced)
CALL_REQUESTS = "rtxserve_triton_call_requests"
BACKEND_UP = "rtxserve_backend_up"  # gauge, by backend
BREAKER_OPEN = "rtxserve_backend_breaker_open"  # gauge, by backend
ALIAS_REQUESTS = "rtxserve_alias_requests_total"  # counter, by alias, model: the target each request was drawn
FALLBACKS = "rtxserve_fallbacks_total"  # counter, by model, fallback: requests its fallback answered
QUOTA_STORAGE_ERRORS = "rtxserve_quota_storage_errors_total"  # counter: quota checks the storage could not answer
AFFINITY = "rtxserve_affinity_total"  # counter, by outcome: preferred / spilled (cache-aware routing)
# On-demand models (serve/gateway/fleet/residency.py)
MODEL_LOADS = "rtxserve_model_loads_total"  # counter, by model, outcome: loaded / failed
MODEL_UNLOADS = "rtxserve_model_unloads_total"  # counter, by model, reason: idle / room
RESIDENCY_TAKEOVERS = "rtxserve_residency_takeovers_total"  # counter: this gateway became the decider (fleet/decider.py)
MODEL_LOAD_SECONDS = "rtxserve_model_load_duration_seconds"  # histogram, by model: from the load's start to ready
MODEL_UNLOAD_SECONDS = "rtxserve_model_unload_duration_seconds"  # histogram, by model: until its memory is free
MODEL_RESIDENT = "rtxserve_model_resident"  # gauge, by model: 1 while an on-demand model is loaded
LOAD_WAITS = "rtxserve_load_waits_total"  # counter, by model, outcome: requests that waited for a load (served / timeout / failed)
BATCH_LINES = "rtxserve_batch_requests_total"  # counter, by status code: batch lines answered (0: not run, cancelled or expired)
BATCHES = "rtxserve_batches_total"  # counter, by status: batches ended (completed / expired / cancelled / failed)
# Promotions (serve/gateway/rollout/): the requests to a name under promotion, by the model that answered and its role
# (current, candidate, or shadow: a copy of a current model's request sent to the candidate, its answer dropped)
ROLLOUT_SECONDS = "rtxserve_rollout_backend_seconds"  # histogram, by model (the name called), target, role
ROLLOUT_REQUESTS = "rtxserve_rollout_requests_total"  # counter, by model, target, role, outcome (ok, error; shadows:
# agree, disagree, ok where the answers are not compared, error)
# The answer cache (serve/gateway/fleet/answer_cache.py): rows of classify, embeddings and NER answered from the gateway's memory
ANSWER_CACHE_LOOKUPS = "rtxserve_answer_cache_lookups_total"  # counter, by model, outcome: hit / miss (one per input row)
ANSWER_CACHE_EVICTIONS = "rtxserve_answer_cache_evictions_total"  # counter, by model: rows dropped to stay within bytes
ANSWER_CACHE_BYTES = "rtxserve_answer_cache_bytes"  # gauge, by model: bytes kept (the sum over the workers)
# The keeper of a `serve up` box (deploy/keeper.py): servers it started again after they died, read from its file
SERVER_RESTARTS = "rtxserve_server_restarts_total"  # counter, by server, outcome: ok (answered ready) / failed
# Live headroom (serve/gateway/fleet/headroom.py): each model's last confirmed capacity (`rtxserve capacity --record`)
# and the share of it the requests of the last HEADROOM_WINDOW_S seconds use; `stale` "true" where the box changed
# (its models or engines) since that capacity was measured
CAPACITY_RPS = "rtxserve_capacity_requests_per_second"  # gauge, by model, stale
CAPACITY_USED = "rtxserve_capacity_used_ratio"  # gauge, by model, stale: requests/s now over the capacity (summed)
