"""Load tests against the gateway over HTTP (locust) and the reports made from their raw samples.

Talks to the gateway over HTTP only; imports nothing from serve/.
"""
