"""A small HTTP client for the server: one POST, and many from client threads (tests, `dllm bench-serve`)."""
from __future__ import annotations

import json
import time


def post(url: str, body: dict | bytes, timeout: float = 300.0) -> tuple[int, dict]:
    """POST a JSON body; returns the status and the decoded JSON answer (errors included; an error that is not
    JSON, such as a proxy's own 500 or 404 text, as OpenAI's error shape)."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw or b"{}")
        except ValueError:
            return e.code, {"error": {"message": raw.decode(errors="replace"), "code": e.code}}


def load(url: str, bodies: list[dict], concurrency: int) -> dict:
    """Send `bodies` to `url` from `concurrency` client threads, each one request after another; returns the
    answers in order with their latencies, and the wall time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(body):
        began = time.perf_counter()
        status, answer = post(url, body)
        return status, answer, time.perf_counter() - began

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, bodies))
    return {"results": results, "seconds": time.perf_counter() - began}
