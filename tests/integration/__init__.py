import time

from serve.vllm_server import TWO_PROCESSES

# vLLM's torch.compile of the model costs 35 s of every engine start on this CPU with a cold inductor cache (13 s
# warm), and no test here measures the compiled model's speed. Fixtures whose subject is not the compile serve
# eagerly; test_serve_up and `make demo` start vLLM as a user's deployment does, compiled.
VLLM_EAGER = ["--enforce-eager"]

# The session's vLLMs run the model in the engine core (serve.vllm_server.TWO_PROCESSES): a ready engine in 17 s instead of
# 25 s here. The integration session sets it (conftest.py); test_serve_up takes it out again and starts vLLM as a user's
# deployment does.
VLLM_TWO_PROCESSES = TWO_PROCESSES


def png(array) -> bytes:
    """An HWC uint8 array as the bytes of a PNG file, as a client would upload it."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def until(condition, what: str, limit_s: float = 30.0) -> None:
    """Poll `condition` until it holds (the tests' synchronisation, instead of sleeps); fail naming `what` after
    `limit_s`."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {limit_s:.0f} s"
        time.sleep(0.02)
