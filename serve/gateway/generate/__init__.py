"""OpenAI's chat and completions, its Responses API and Anthropic's Messages API over vLLM: bounded, routed and
relayed as vLLM answers, usage counted; engine_routes.py says which of vLLM's other routes are relayed or refused."""
