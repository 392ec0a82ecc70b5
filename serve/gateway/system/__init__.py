"""What a gateway says of itself: liveness, readiness (each model's canary), `/v1/models`, `/metrics`."""
