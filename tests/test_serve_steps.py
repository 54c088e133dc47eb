"""`dllm serve`'s step events (`step_events: true` on a stream) and the playground page at /: the events, applied in
order to a blank canvas, give the answer canvas `dllm.generate` gives for the prompt alone, on a masked model (one
commit a step for low_confidence; WINO's take-backs) and a uniform-state one (DiffusionGemma's drafts replaced)."""
import http.client
import json
import re
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import dllm  # noqa: E402
from dllm import cache as caches  # noqa: E402
from dllm import samplers  # noqa: E402
from dllm.serve import Engine, EngineClient, EngineSpec, LocalServer, post  # noqa: E402
from dllm.serve.requests import RequestReader, served_defaults  # noqa: E402

DEFAULTS = {"sampler": None, "cache": None, "sampler_args": {}, "cache_args": {}, "gen_length": None,
            "block_length": None, "steps": None, "seed": 0}  # `dllm serve`'s own: the model's sampler and cache


def serving(name: str):
    model = dllm.load(name, weights=False)[0]
    return LocalServer(EngineClient.spawn(EngineSpec(name, max_batch=4), served_defaults(model, DEFAULTS)))


@pytest.fixture(scope="module")
def llada_server():
    with serving("tiny-llada") as local:
        yield local


def stream(url: str, body: dict) -> list[dict]:
    """A streamed chat answer's events, in order ([DONE] left out)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    data = [line[6:].decode().strip() for line in response if line.startswith(b"data: ")]
    conn.close()
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def replay(steps: list[dict], length: int) -> list:
    """The answer canvas the step events leave: token ids where committed, None where blank (a draft counts as
    blank: not committed)."""
    canvas: list = [None] * length
    for event in steps:
        for p, _, _ in event["drafts"]:
            assert canvas[p] is None  # only positions not yet committed are redrawn
        for p in event["remasked"]:
            assert canvas[p] is not None
            canvas[p] = None
        for p, token, _ in event["committed"]:
            canvas[p] = token
    return canvas


def decoded(url: str, model, tok, prompt: str, **params) -> tuple[list[dict], list[dict], dllm.Generation]:
    """The step events and the other events of a streamed answer, and `dllm.generate`'s answer alone."""
    events = stream(url, {"messages": [{"role": "user", "content": prompt}], "step_events": True, **params})
    steps = [e for e in events if e["object"] == "dllm.step"]
    return steps, [e for e in events if e["object"] != "dllm.step"], dllm.generate(model, tok, prompt, **params)


def test_low_confidence_commits_one_a_step_and_replays_to_the_answer(llada_server, tiny_llada):
    steps, chunks, alone = decoded(llada_server.url, *tiny_llada, "reverse: abc12", sampler="low_confidence",
                                   gen_length=32, block_length=16, steps=32)
    assert replay(steps, 32) == alone.canvas_ids[0]
    assert len(steps) > 1 and [e["step"] for e in steps] == list(range(1, len(steps) + 1))
    *before_stop, _ = steps  # the step that commits the stop fills the rest with it
    assert all(len(e["committed"]) == 1 and not e["remasked"] and not e["drafts"] for e in before_stop)
    assert [e["forwards"] for e in steps] == [e["step"] for e in steps] and steps[-1]["forwards"] == alone.stats.nfe
    assert chunks[0]["choices"][0]["delta"]["content"] == alone.texts[0]  # the block's text after its steps


def test_wino_takes_tokens_back_and_commits_them_again(llada_server, tiny_llada):
    steps, _, alone = decoded(llada_server.url, *tiny_llada, "sort: 09,04,07,01", sampler="wino", threshold=0.2,
                              remask_threshold=0.9999, gen_length=32, block_length=16)
    taken = [(e["step"], p) for e in steps for p in e["remasked"]]
    assert taken
    assert all(any(e["step"] > step and any(c[0] == p for c in e["committed"]) for e in steps) for step, p in taken)
    assert replay(steps, 32) == alone.canvas_ids[0]


def test_only_rows_that_asked_get_events_and_they_leave_between_steps(tiny_llada):
    """Two rows of one batch, one asking: every event is its, each taken at the step that made it (the engine
    process sends them from `poll`), all before the block's deltas."""
    model, tok = tiny_llada
    reader, engine = RequestReader(model, tok, "tiny-llada", served_defaults(model, DEFAULTS)), Engine(model, tok)
    jobs = [reader.job({"messages": [{"role": "user", "content": p}], "gen_length": 32, "block_length": 16,
                        "stream": True, "step_events": asks}, chat=True)
            for p, asks in (("reverse: abc12", True), ("copy: k3x9a", False))]
    for job in jobs:
        engine.add(job.message())
    engine._admit()
    assert [len(group.tasks) for group in engine.groups] == [2]  # one batch
    taken: list[list] = []
    engine.poll = lambda: taken.append(engine.take_steps())
    engine.step()
    assert all(len(events) <= 1 for events in taken) and sum(map(len, taken)) > 1
    assert {e.req_id for events in taken for e in events} == {jobs[0].id}
    assert [e.step for events in taken for e in events] == [i + 1 for i, events in enumerate(taken) if events]
    assert engine.take_steps() == [] and engine.take()  # the block's deltas come after


def test_the_default_stream_has_no_step_events_and_asking_needs_a_stream(llada_server):
    events = stream(llada_server.url, {"messages": [{"role": "user", "content": "copy: k3x9a"}]})
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    status, answer = post(llada_server.url + "/v1/completions", {"prompt": "copy: k3x9a", "step_events": True})
    assert status == 400
    assert answer["error"]["message"] == "step_events streams an event per decoding step; send stream: true with it"
    status, answer = post(llada_server.url + "/v1/completions", {"prompt": "x", "stream": True, "step_events": 1})
    assert status == 400 and answer["error"]["message"] == "step_events must be true or false, got 1"


def test_page_and_decoding_list_are_served_from_this_origin(llada_server):
    with urllib.request.urlopen(llada_server.url + "/") as r:
        page = r.read().decode()
        assert r.headers["content-type"].startswith("text/html")
    assert "<canvas" not in page and 'id="canvas"' in page
    assert not re.search(r"(src|href)=\"(https?:)?//", page) and "https://" not in page and "http://" not in page
    assert set(re.findall(r"fetch\(\"([^\"]+)\"", page)) == {"/decoding"}  # and the two completions endpoints
    with urllib.request.urlopen(llada_server.url + "/decoding") as r:
        listed = json.loads(r.read())
    assert [s["name"] for s in listed["samplers"]] == [cls.describe()["name"] for cls in samplers.SAMPLERS]
    assert listed["caches"] == json.loads(json.dumps([cls.describe() for cls in caches.CACHES], default=str))
    assert listed["defaults"]["sampler"] == "low_confidence" and listed["defaults"]["gen_length"] == 64
    assert listed["uniform_state"] is False and listed["model"] == "tiny-llada"
    with urllib.request.urlopen(llada_server.url + "/openapi.json") as r:
        schema = json.loads(r.read())
    assert all("step_events" in branch["properties"]  # a body branch per served sampler (`dllm.serve.contract`)
               for branch in schema["components"]["schemas"]["ChatRequest"]["oneOf"])
    assert all("dllm.step" in branch["properties"]["step_events"]["description"]
               for branch in schema["components"]["schemas"]["CompletionRequest"]["oneOf"])


def test_uniform_state_drafts_are_replaced_by_commits():
    """DiffusionGemma: positions not yet committed hold drafts that later steps replace with committed tokens."""
    model, tok = dllm.load("tiny-dgemma")
    with serving("tiny-dgemma") as local:
        steps, _, alone = decoded(local.url, model, tok, "reverse: abc12")
        with urllib.request.urlopen(local.url + "/decoding") as r:
            assert json.loads(r.read())["uniform_state"] is True
    drafted = {p for e in steps for p, _, _ in e["drafts"]}
    assert drafted and all(any(c[0] == p for e in steps for c in e["committed"]) for p in drafted)
    assert replay(steps, len(alone.canvas_ids[0])) == alone.canvas_ids[0]
