"""The admin API (admin keys only): LoRA adapters loaded and unloaded on a running box, and the promotions' steps
(`rtxserve promote` drives them)."""
