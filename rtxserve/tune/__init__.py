"""`rtxserve tune triton|vllm`: search a server's knobs for the configuration that holds the most load within an
SLO, each configuration served by freshly started servers; recommend the best and, for Triton with --apply, write
it into the repository.

- triton: one entry's instances x max_batch_size x queue delay (serve/entry_config.py);
- vllm: the engine's --max-num-seqs x --max-num-batched-tokens.

The search is Triton Model Analyzer's quick search: measure the server as it is (the default, so that the
recommendation is compared with it in the same run), then climb from the smallest configuration, each
time measuring the untried neighbours (one step along one axis) of the best so far, until none is better
or the budget of configurations is spent.

What each configuration is measured by (`--measure`):
- capacity (the default): the capacity search of `rtxserve capacity` (loadtest/capacity.py: open-loop arrivals, a
  ramp and a bisection, no confirm runs) finds the most requests/s it holds with its P99 within the SLO, at most
  1 % failed and keeping up; the configuration that holds the most wins. A configuration whose first step misses is
  searched once more (a freshly started server's first seconds can stall); if it misses again it holds nothing and
  does not qualify.
- goodput: one run at a fixed load (`--users` closed-loop users, or `--rate`); a configuration qualifies if its P99
  meets the SLO and at most 1 % of its requests failed; among those, goodput (requests/s within every limit) wins.

The rooms: `search.py` (the configurations, the climb, measuring each one), `run.py` (`tune`), `targets.py` (what
is tuned: a Triton entry, a vLLM engine), `report.py` (the page, its table and plot), `cli.py` (`rtxserve tune`).
"""

from .cli import main
from .run import tune
from .search import MEASURES, Search, Trial, TuneResult, evaluate, quick_search
from .targets import SCENARIO_OF_TASK, TritonTarget, VLLMTarget

__all__ = ["MEASURES", "SCENARIO_OF_TASK", "Search", "Trial", "TritonTarget", "TuneResult", "VLLMTarget", "evaluate",
           "main", "quick_search", "tune"]
