"""Speech to text for vLLM (`rtxserve export speech`): Whisper fine-tunes and LoRAs on them (whisper.py)."""
