"""Which replica serves a request: what each replica serves and whether it is ready (registry, canaries), the model a
request names and the replica chosen (dispatch, prefix affinity, people before batches), on-demand loading
(residency) and the answer cache."""
