"""What several gateways share (a box's workers, a fleet's pods): one database and its schema.

- `db.py`: an engine for it: SQLite (a file one box's workers share) or PostgreSQL (a server a fleet reaches), its
  password given apart from the URL, a server that does not answer given up on in seconds.
- `migrations/`: its schema, brought to the newest revision by whichever gateway opens it first (alembic).

Its users: the Files and Batch APIs (batches/store.py: files, batches, per-batch leases) and the residency decider
(fleet/decider.py: which on-demand models are loaded, decided by one gateway for all).
"""
