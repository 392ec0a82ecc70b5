"""`rtxserve promote BOX --model NAME --to CANDIDATE`: a new fine-tune put in front of the old one on a running box,
with no request lost, and taken back on any breach.

- cli.py: the command, and the check before anything loads (the same task, labels and tokenizer);
- driver.py: the steps, each through the gateway's admin routes (serve/gateway/admin/promotions.py) with the lease
  renewed beside them: load, the eval gate (rtxserve eval's comparison, on both models), shadow, canary steps, switch,
  rollback window, finish; a rollback at the first breach;
- figures.py: each step's requests, errors and latency by role, from the gateway's /metrics;
- report.py: one report for the whole promotion (md, html, png, json).
"""
