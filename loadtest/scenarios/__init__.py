"""What locust runs: the locustfile, one call per API (apis.py) and what counts as its answer (answers.py), the workloads
and their options, stages, the replay of recorded traces (replayer.py) and the raw-sample recorder every report is made
from."""
