"""The servers behind the gateway: Triton over gRPC (aio, calls coalesced while one is out) and vLLM over HTTP
(aiohttp, streams relayed as they come); base.py is what the APIs see of either, factory.py makes them from the
settings."""
