"""The OpenAI Files and Batch APIs: JSONL files of requests, run by the gateway at batch priority.

- `store.py`: the files and the batches' state: SQLite and files on disk under `batch_dir` (what a restart keeps), or
  a PostgreSQL several gateways share (`batch_store_url`), which keeps the files' bytes too;
- `lines.py`: a batch's input file read and checked line by line, before anything runs;
- `runner.py`: a runner in each gateway worker; each batch run by the one holding its lease, each line a request
  through the gateway's own front door;
- `router.py`: `/v1/files` and `/v1/batches`.
"""
