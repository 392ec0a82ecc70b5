"""The report of a load test: a run's raw samples turned into figures, plots and pages, two runs set side by side,
and a replay set beside the trace it replayed. (The replayer itself, which reads a trace and turns it into requests,
is loadtest/scenarios/replayer.py; the servers' /metrics scraped during a run, loadtest/server_metrics.py.)

- report.py: the figures from the raw samples (P50/P90/P99/P99.9, QPS, errors, goodput under an SLO, per API of a
  mix, late open-loop arrivals, streaming TTFT / ITL / TPOT), and the samples read back from a run's folder;
- plots.py: the run's plots (latency over time beside its distribution, streaming figures, the servers' own figures
  under the client's latency), and the pyplot every other page of ours draws with;
- pages.py: the pages (report.json, summary.csv, report.md and the same page as self-contained HTML with its
  plots embedded, run metadata, the servers' side beside the client's);
- compare.py: `rtxserve loadtest compare`: two runs or two sweeps (or two models that answered one run) side by
  side, every figure with its change and their curves overlaid;
- replayed.py: a replay beside its trace, recorded vs replayed (arrivals, sizes, latency, cache hits): the report's
  "Recorded vs replayed" section and its plot.
"""
