"""The playground page of `dllm serve` in a real browser (headless Chromium through selenium, on loopback): it decodes
a prompt live (more than one canvas state for a multi-step sampler, WINO's take-backs drawn), ends with the text the
server's own completion gives for the same settings, and shows a refused parameter's one-line error."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from playground_screenshot import Playground, missing_browser  # noqa: E402

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
if missing_browser():
    pytest.skip(f"the playground's browser test needs a browser: {missing_browser()}", allow_module_level=True)

import dllm  # noqa: E402
from dllm.serve import EngineClient, EngineSpec, LocalServer, post  # noqa: E402
from dllm.serve.requests import served_defaults  # noqa: E402

DEFAULTS = {"sampler": None, "cache": None, "sampler_args": {}, "cache_args": {}, "gen_length": None,
            "block_length": None, "steps": None, "seed": 0}


@pytest.fixture(scope="module")
def server():
    defaults = served_defaults(dllm.load("tiny-llada", weights=False)[0], DEFAULTS)
    with LocalServer(EngineClient.spawn(EngineSpec("tiny-llada"), defaults)) as local:
        yield local


@pytest.fixture
def page(server):
    """The page freshly loaded (its fields at the server's defaults)."""
    with Playground(server.url + "/") as playground:
        playground.url = server.url
        yield playground


def completion(url: str, prompt: str, **body) -> tuple[int, dict]:
    return post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **body})


def test_the_page_decodes_step_by_step_to_the_servers_answer(page):
    page.send("reverse: abc12", "low_confidence", gen_length=32, block_length=16, steps=32)
    shown = page.finished()
    assert shown["error"] == ""
    states = shown["states"]
    assert len(states) > 1 and len({str(s) for s in states}) == len(states)  # every step changed the canvas
    assert sum(c["kind"] == "token" for c in states[0]) == 1  # one committed at the first step
    status, answer = completion(page.url, "reverse: abc12", sampler="low_confidence", gen_length=32,
                                block_length=16, steps=32)
    assert status == 200 and shown["answer"] == answer["choices"][0]["message"]["content"]
    assert shown["numbers"].startswith(f"{len(states)} forwards · ")


def test_wino_shows_tokens_taken_back(page):
    page.send("sort: 09,04,07,01", "wino", gen_length=32, block_length=16, threshold=0.2, remask_threshold=0.9999)
    shown = page.finished()
    assert any("taken" in c["kind"] for s in shown["states"] for c in s)  # a red, re-masked cell at some step
    assert all("taken" not in c["kind"] and c["kind"] != "blank" for c in shown["states"][-1][:16])
    status, answer = completion(page.url, "sort: 09,04,07,01", sampler="wino", gen_length=32, block_length=16,
                                threshold=0.2, remask_threshold=0.9999)
    assert status == 200 and shown["answer"] == answer["choices"][0]["message"]["content"]


def test_llada_options_from_the_page_reach_the_server(page):
    """The page's cfg_scale and confidence_eos_eot_inf fields are sent: each with a sampler or cache that refuses it
    shows the server's reason."""
    page.element("confidence_eos_eot_inf").click()
    page.send("reverse: abc12", "entropy")
    status, answer = completion(page.url, "reverse: abc12", sampler="entropy", confidence_eos_eot_inf=True)
    assert status == 400 and page.finished()["error"] == answer["error"]["message"]
    page.element("confidence_eos_eot_inf").click()
    page.send("reverse: abc12", "low_confidence", "elastic", cfg_scale=1.5)
    status, answer = completion(page.url, "reverse: abc12", sampler="low_confidence", cache="elastic", cfg_scale=1.5)
    assert status == 400 and page.finished()["error"] == answer["error"]["message"]
    assert "cfg_scale" in answer["error"]["message"]


def test_a_refused_parameter_shows_the_servers_error(page):
    page.send("reverse: abc12", "threshold", threshold="high")
    shown = page.finished()
    status, answer = completion(page.url, "reverse: abc12", sampler="threshold", threshold="high", stream=True)
    assert status == 400 and shown["error"] == answer["error"]["message"] and "\n" not in shown["error"]
    assert "threshold" in shown["error"] and shown["answer"] == ""
