from serve.vllm_server import TWO_PROCESSES
from tests import until  # noqa: F401 (the integration tests' import of it)

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


def routes_not_through_the_gateway(gateway: str, engine: str) -> list[str]:
    """What is wrong with how the gateway fronts the routes a vLLM engine serves (its /openapi.json): each must be
    answered (relayed, or the gateway's own) unless serve/gateway/generate/engine_routes.py refuses it on purpose (404)."""
    import httpx

    from serve.gateway.generate.engine_routes import REFUSED

    problems = []
    for path, methods in httpx.get(f"{engine}/openapi.json", timeout=30).json()["paths"].items():
        for method in methods:
            status = httpx.request(method.upper(), gateway + path.replace("{response_id}", "resp_0")
                                   .replace("{adapter_name}", "adapter-a"),
                                   json={} if method in ("post", "put") else None, timeout=30).status_code
            gone = status in (404, 405)
            if path in REFUSED and not gone:
                problems.append(f"{method.upper()} {path}: refused on purpose, but the gateway answered {status}")
            elif path not in REFUSED and gone:
                problems.append(f"{method.upper()} {path}: {status} from the gateway; relay it, or write in "
                                "serve/gateway/generate/engine_routes.py why not")
    return problems
