"""Who may call what, and how much: API keys and the keys CLI, the route dependency that checks them, per-key quotas,
the caller of the request being served, and the token usage charged to it."""
