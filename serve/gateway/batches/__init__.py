"""The OpenAI Files and Batch APIs: JSONL files of requests, run by the gateway at batch priority.

- `store.py`: the files on disk and the batches' state in SQLite, under `batch_dir` (what a restart keeps);
- `lines.py`: a batch's input file read and checked line by line, before anything runs;
- `runner.py`: one runner per box runs the batches, each line a request through the gateway's own front door;
- `router.py`: `/v1/files` and `/v1/batches`.
"""
