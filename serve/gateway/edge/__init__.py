"""What every request passes on its way in and out, before and around any route: the front door (request ids, bodies,
overhead), admission (the concurrency gate), the hot path for classify / embeddings / NER, the traffic recording,
OpenTelemetry spans, JSON logs and the orjson route class."""
