"""`engine serve` against hostile clients, as a real process: bodies too deep, too big or not numbers are
400/413; clients that send their head a byte at a time are closed at the head deadline and never lock
others out for good; a web page's cross-origin post and a rebound DNS name are refused on loopback;
fields kvchat does not implement are refused, not ignored; serving beyond loopback without a key warns."""

import socket
import time

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from engine.http.server import BODY_BYTES, HEAD_SECONDS, MAX_CONNECTIONS

MODEL = "kvchat-demo"
TURN1 = [{"role": "user", "content": "hi"}]


def post(server, content: bytes, **headers):
    headers = {"content-type": "application/json", **headers}
    return httpx.post(server.url + "/chat/completions", content=content, headers=headers, timeout=30)


def test_bodies_that_are_too_deep_too_big_or_not_numbers_are_refused(serve):
    server = serve()
    deep = post(server, b"[" * 100_000 + b"]" * 100_000)
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    nan = post(server, b'{"model": "kvchat-demo", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}')
    assert nan.status_code == 400 and "NaN" in nan.json()["error"]["message"]
    port = int(server.root.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # a length declared, nothing sent
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
        s.sendall(b"Content-Length: %d\r\n\r\n" % (BODY_BYTES + 1))
        assert s.recv(4096).startswith(b"HTTP/1.1 413")

    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # chunked: no length, past the limit
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
        s.sendall(b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b" " * (1 << 20)
        for _ in range(BODY_BYTES // len(piece) + 1):  # one MiB past the limit, then nothing: no end chunk
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        assert s.recv(4096).startswith(b"HTTP/1.1 413")  # answered at the limit, not after a body that never ends
    for name, value in (("tool_choice", "auto"),):  # a choice among no tools: OpenAI's 400
        r = httpx.post(server.url + "/chat/completions", json={"model": MODEL, "messages": TURN1, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name
        assert "is only allowed with tools" in r.json()["error"]["message"]
    nonsense = {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}
    for fmt, words in (({"type": "xml"}, "must be text, json_object or json_schema"),
                       ({"type": "json_schema", "json_schema": {"schema": 3}}, "must be a JSON schema"),
                       (nonsense, "does not compile: Invalid type: nonsense")):  # fmt: skip
        r = httpx.post(
            server.url + "/chat/completions", json={"model": MODEL, "messages": TURN1, "response_format": fmt}
        )
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.json()
    alone = httpx.post(server.url + "/chat/completions", json={"model": MODEL, "messages": TURN1, "top_logprobs": 3})
    assert alone.status_code == 400 and "needs 'logprobs'" in alone.json()["error"]["message"]
    many = {"model": MODEL, "messages": TURN1, "logprobs": True, "top_logprobs": 99}
    r = httpx.post(server.url + "/chat/completions", json=many)
    assert r.status_code == 400 and "between 0 and" in r.json()["error"]["message"]
    some = httpx.post(server.url + "/chat/completions", json={**many, "top_logprobs": 3, "max_tokens": 2})
    assert some.status_code == 200
    assert [len(e["top_logprobs"]) for e in some.json()["choices"][0]["logprobs"]["content"]] == [3, 3]
    ok = httpx.post(server.url + "/chat/completions", json={"model": MODEL, "messages": TURN1, "max_tokens": 2})
    assert ok.status_code == 200 and "Traceback" not in server.output()


def test_clients_that_never_finish_their_head_are_closed_at_the_deadline(serve):
    server = serve()
    port = int(server.root.rsplit(":", 1)[1])
    slow = []
    for _ in range(MAX_CONNECTIONS + 16):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
        slow.append(s)
    deadline = time.monotonic() + HEAD_SECONDS + 10
    open_ = list(slow)
    while open_ and time.monotonic() < deadline:
        for s in list(open_):
            s.settimeout(0.05)
            try:
                s.recv(4096)  # b"": closed; or the 503 of a server at its connection limit
                open_.remove(s)
            except TimeoutError:  # still held open, unanswered
                pass
    assert open_ == []  # every one closed by the server
    for s in slow:
        s.close()
    r = httpx.post(server.url + "/chat/completions", json={"model": MODEL, "messages": TURN1, "max_tokens": 2})
    assert r.status_code == 200


def test_web_pages_and_rebound_names_cannot_reach_a_loopback_server(serve):
    server = serve()
    body = b'{"model": "kvchat-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    cross = post(server, body, **{"content-type": "text/plain", "origin": "http://evil.example"})
    assert cross.status_code == 403 and "evil.example" in cross.json()["error"]["message"]
    json_cross = post(server, body, origin="https://evil.example")
    assert json_cross.status_code == 403
    rebound = post(server, body, host="evil.example:8000")
    assert rebound.status_code == 403 and "localhost" in rebound.json()["error"]["message"]
    for host in ("localhost:1234", "127.0.0.1", "[::1]:8000"):
        assert post(server, body, host=host).status_code == 200
    assert post(server, body, origin="http://localhost:3000").status_code == 200  # a page on this machine


def test_serving_beyond_loopback_without_a_key_warns(serve):
    server = serve("--host", "0.0.0.0")
    assert "warning: serving on 0.0.0.0 without --api-key" in server.output()
    body = b'{"model": "kvchat-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    assert post(server, body, host="kvchat.lan:8000").status_code == 200  # any name, off loopback
    cross = post(server, body, **{"content-type": "text/plain", "origin": "http://evil.example"})
    assert cross.status_code == 403


def test_clients_that_give_up_while_queued_free_their_handlers(serve):
    """Clients that leave while their request waits behind a running stream: ten rounds of eight (more than the
    64 connections uvicorn admits, were each to keep its handler), then a request is still answered."""
    import json as _json

    server = serve()
    port = int(server.root.rsplit(":", 1)[1])
    body = _json.dumps({"model": MODEL, "messages": TURN1, "max_tokens": 8}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    post = head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    hold = {"model": MODEL, "messages": TURN1, "max_tokens": 4000, "stream": True}
    for _ in range(10):
        with httpx.stream("POST", server.url + "/chat/completions", json=hold, timeout=60) as running:
            next(running.iter_lines())  # the engine is busy with this one
            queued = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
            for s in queued:
                s.sendall(post)
            time.sleep(0.2)
            for s in queued:  # they give up while waiting
                s.close()
            time.sleep(0.1)
    time.sleep(0.5)
    ok = httpx.post(server.url + "/chat/completions", json={"model": MODEL, "messages": TURN1, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert httpx.get(server.root + "/health").status_code == 200
