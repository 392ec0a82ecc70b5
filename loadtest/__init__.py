"""Load tests against the gateway over HTTP (locust: scenarios/) and the reports made from their raw samples (report/).

Talks to the gateway over HTTP only; imports nothing from serve/.
"""
