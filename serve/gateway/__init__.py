"""The gateway: a FastAPI app in front of Triton and vLLM (app.py wires it). One folder per API (protocol: its wire
models; router: its routes; serving: what it does), standing on the rooms every API shares: state (one part per job),
fleet (which replica serves a request), edge (what every request passes), backends, inputs, access, and the ground
(settings, metrics, exceptions); batches/ runs the Files and Batch APIs through the gateway's own front door."""
