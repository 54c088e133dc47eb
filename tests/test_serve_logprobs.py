"""`logprobs` over HTTP in OpenAI's shapes: equal to `dllm.generate(logprobs=k)`, one entry per completion token,
streamed with the chunk whose text they make, and one-line 400s for bad values."""
import http.client
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from test_serve import server, tiny  # noqa: E402,F401  (the served tiny-llada, `dllm serve`'s defaults)

import dllm  # noqa: E402
from dllm.serve import post  # noqa: E402


def streamed(url, path, body):
    """The JSON chunks of a streamed answer."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    lines = [line[6:].decode().strip() for line in conn.getresponse() if line.startswith(b"data: ")]
    conn.close()
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completions_logprobs_equal_generate(server, tiny):
    """`logprobs: 3` on /v1/completions: tokens, their log-probabilities (those `dllm.generate(logprobs=3)`
    returns), the 3 best plus the chosen token, and where each token's text starts in the answer."""
    model, tok = tiny
    body = {"prompt": "reverse: abc12", "temperature": 0.7, "seed": 4, "logprobs": 3, "sampler": "threshold",
            "cache": "dual", "gen_length": 32, "block_length": 4}
    status, answer = post(server.url + "/v1/completions", body)
    assert status == 200
    choice = answer["choices"][0]
    want = dllm.generate(model, tok, "reverse: abc12", chat=False, temperature=0.7, seed=4, logprobs=3,
                         sampler="threshold", cache="dual", gen_length=32, block_length=4).logprobs[0]
    got = choice["logprobs"]
    assert len(got["tokens"]) == answer["usage"]["completion_tokens"] == len(want) > 0
    assert got["tokens"] == [tok.decode([t.token]) for t in want]
    assert got["token_logprobs"] == pytest.approx([t.logprob for t in want], abs=1e-5)
    for top, token in zip(got["top_logprobs"], want):
        assert top == pytest.approx({tok.decode([i]): v for i, v in [*token.top, (token.token, token.logprob)]},
                                    abs=1e-5)
    text = choice["text"]
    assert [text[o:o + len(t)] for o, t in zip(got["text_offset"], got["tokens"])] == got["tokens"]
    parts = [c["choices"][0]["logprobs"] for c in streamed(server.url, "/v1/completions", body)]
    assert sum(p is not None for p in parts) > 1
    assert {key: [v for p in parts if p for v in p[key]] for key in got} == got  # offsets go on across chunks


def test_chat_logprobs_and_their_stream(server):
    """`logprobs: true, top_logprobs: 2` on /v1/chat/completions: an entry per completion token (token, logprob,
    bytes, 2 alternatives) whose tokens spell the answer; streamed, each chunk carries the entries of its text,
    and together they are the whole answer's."""
    body = {"messages": [{"role": "user", "content": "add: 0062+8111"}], "logprobs": True, "top_logprobs": 2,
            "block_length": 16, "gen_length": 64}
    status, answer = post(server.url + "/v1/chat/completions", body)
    assert status == 200
    choice = answer["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    assert all(len(c["top_logprobs"]) == 2 and bytes(c["bytes"]).decode() == c["token"] for c in content)
    assert all(c["logprob"] <= c["top_logprobs"][0]["logprob"] + 1e-6 for c in content)  # T = 0: the best one
    chunks = streamed(server.url, "/v1/chat/completions", body)
    parts = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert len(parts) > 1
    assert all("".join(c["token"] for c in p["logprobs"]["content"]) == p["delta"]["content"] for p in parts)
    assert [c for p in parts for c in p["logprobs"]["content"]] == content


def test_a_stop_string_keeps_one_logprob_per_counted_token(server):
    """A stop string cuts the text, not the tokens counted through it: every counted token has its entry, streamed
    or not (the tokens of the stop string come with the final chunk)."""
    body = {"messages": [{"role": "user", "content": "copy: abcdefgh"}], "stop": ["cd"], "block_length": 4,
            "gen_length": 32, "logprobs": True}
    status, answer = post(server.url + "/v1/chat/completions", body)
    content = answer["choices"][0]["logprobs"]["content"]
    assert status == 200 and answer["choices"][0]["message"]["content"] == "#### ab"
    assert "".join(c["token"] for c in content) == "#### abcd" == "#### ab" + "cd"
    assert len(content) == answer["usage"]["completion_tokens"]
    chunks = streamed(server.url, "/v1/chat/completions", body)
    assert [c for chunk in chunks if chunk["choices"][0]["logprobs"]
            for c in chunk["choices"][0]["logprobs"]["content"]] == content
    assert chunks[-1]["choices"][0]["logprobs"] is not None  # "cd" with the finish reason


def test_no_logprobs_asked_gives_null(server):
    for path, body in (("/v1/completions", {"prompt": "copy: ab"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "copy: ab"}]})):
        status, answer = post(server.url + path, body)
        assert status == 200 and answer["choices"][0]["logprobs"] is None


BAD = [
    ("/v1/completions", {"prompt": "copy: ab", "logprobs": 21}, "logprobs must be at most 20, got 21"),
    ("/v1/completions", {"prompt": "copy: ab", "logprobs": True}, "logprobs must be an integer, got True"),
    ("/v1/completions", {"prompt": "copy: ab", "top_logprobs": 2},
     "top_logprobs is a chat field; on /v1/completions send logprobs: k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
     "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": 3},
     "logprobs must be true or false on /v1/chat/completions, got 3; send top_logprobs: k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": -1},
     "top_logprobs must be at least 0, got -1"),
]


@pytest.mark.parametrize("path,body,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_logprobs_get_400(server, path, body, message):
    status, answer = post(server.url + path, body)
    assert status == 400 and message in answer["error"]["message"]
