"""Closed-loop text classification: each user posts to /v1/classify as soon as its last answer came.

Env: RTXSERVE_MODEL (model name), RTXSERVE_BATCH (texts per request, default 1), RTXSERVE_HONOUR_RETRY_AFTER
(1: after a 429 / 503 with Retry-After a user waits that long, as the openai SDK and well-behaved clients do;
default 0: it sends again at once, the worst case for the server).
"""

import os
import random
import time

from locust import FastHttpUser, constant, task

from loadtest.scenarios import samples  # noqa: F401  (registers the raw-sample recorder)

MODEL = os.environ.get("RTXSERVE_MODEL", "")
BATCH = int(os.environ.get("RTXSERVE_BATCH", "1"))
HONOUR_RETRY_AFTER = os.environ.get("RTXSERVE_HONOUR_RETRY_AFTER", "0") == "1"
TEXTS = [
    "I love this product, it works perfectly.",
    "Terrible. It broke after one day and support never answered.",
    "The package arrived on Tuesday.",
    "Great value, would buy again.",
    "Not what I expected; the colour is different from the photos and the fabric feels cheap.",
    "ok",
    "Shipping took three weeks, but the item itself is excellent and my kids use it every day.",
]


class ClassifyUser(FastHttpUser):
    wait_time = constant(0)

    @task
    def classify(self):
        texts = random.choices(TEXTS, k=BATCH)
        with self.client.post("/v1/classify", json={"model": MODEL, "input": texts},
                              name="classify", catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {(response.text or '')[:120]}")
                retry_after = response.headers.get("retry-after")
                if HONOUR_RETRY_AFTER and response.status_code in (429, 503) and retry_after:
                    time.sleep(float(retry_after))  # cooperative: locust runs users on gevent
                return
            data = response.json().get("data", [])
            if len(data) != len(texts) or not all(isinstance(d.get("label"), str) for d in data):
                response.failure(f"expected {len(texts)} labelled results, got {len(data)}")
