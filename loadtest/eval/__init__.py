"""`rtxserve eval`: a model's reference set (core/reference.py: inputs, and what the training framework answered on
them) sent through a served box, through the gateway, as a client sends it, and the answers compared:

- families.py: per task, the request each input becomes and how its answer is compared (label agreement and max
  |Δlogit|, entities, cosine, matched detections, greedy continuations and their log-probabilities, WER, PSNR), with
  the thresholds each family holds by default;
- run.py: the requests, one input at a time, and the verdict;
- report.py: the report (Markdown, HTML, a plot of each input's drift against its threshold) and the JSON.
"""
