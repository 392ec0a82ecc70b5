"""Put on the vLLM process's PYTHONPATH (serve/vllm_server.py:install_env) so that Python imports `sitecustomize` from here
at every start: in vLLM's API server and in each process it spawns."""
