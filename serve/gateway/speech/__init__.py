"""OpenAI's audio API over vLLM's Whisper engines: transcriptions and translations."""
