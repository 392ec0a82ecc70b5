import time


def until(condition, what: str = "the condition", limit_s: float = 30.0) -> None:
    """Poll `condition` until it holds (the tests' synchronisation, instead of sleeps); fail naming `what` after
    `limit_s`."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {limit_s:.0f} s"
        time.sleep(0.01)
