"""A remote server cannot grow the app or hang it: a line that never ends, a chunk that claims a billion
tokens, a stream without end, a model list that trickles, a malformed card, a redirect and an HTML page
are each a clear error (or a reply cut at the request's own max_tokens), within the stated limits."""

import resource
import time

import pytest

pytest.importorskip("httpx")

from servers import HostileServer

from engine.http.remote import CONNECT_TIMEOUT_S, LINE_BYTES, RemoteError, RemoteSession, RemoteSpec, list_models
from engine.session import Request

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
def hostile():
    made = []

    def make(mode, **kw):
        made.append(HostileServer(mode, **kw))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def reply(server, **req):
    remote = RemoteSession(RemoteSpec(server.url))
    try:
        remote.connect()
        return list(remote.generate(Request(messages=HELLO, **req)))
    finally:
        remote.close()


def grown_mb(before_kb: int) -> float:
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb) / 1024


def test_a_line_that_never_ends_is_cut_at_the_line_limit(hostile):
    server = hostile("endless-line")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    events = reply(server, max_new_tokens=16)
    assert type(events[-1]).__name__ == "Failed" and "a line longer than 1 MiB" in events[-1].error
    assert server.sent < 16 * LINE_BYTES  # it stopped near the limit (plus what the sockets buffer), not at 1.7 GB
    assert grown_mb(before) < 64


def test_a_chunk_claiming_a_billion_tokens_counts_at_most_what_was_asked(hostile):
    server = hostile("huge-tokens")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    events = reply(server, max_new_tokens=16)
    fin = events[-1]
    assert type(fin).__name__ == "Finished" and fin.text == "hi"
    tokens = [e for e in events if type(e).__name__ == "Token"]
    assert len(tokens) == 1 and tokens[0].index <= 16 + 2  # a token per byte of "hi" at most, never 10^9
    assert grown_mb(before) < 64


def test_a_stream_without_end_stops_at_the_requests_max_tokens(hostile):
    server = hostile("never-ends")
    events = reply(server, max_new_tokens=16)
    fin = events[-1]
    assert type(fin).__name__ == "Finished" and fin.reason == "max_new_tokens"
    assert fin.text == " word" * 16
    assert server.disconnected.wait(5)  # the stream was closed, not left running


def test_a_trickling_model_list_is_cut_off_at_its_deadline(hostile):
    server = hostile("trickle-models", trickle=0.5)  # a byte every half second: each read is quick
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match=f"did not answer within {CONNECT_TIMEOUT_S:g} s"):
        RemoteSession(RemoteSpec(server.url)).connect()
    assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 2


def test_a_malformed_card_is_read_with_what_can_be_read(hostile):
    server = hostile("bad-card")
    cards = list_models(RemoteSpec(server.url))
    assert [c["id"] for c in cards] == ["org/hostile"]  # a card that is not an object, or has no id, is left out
    remote = RemoteSession(RemoteSpec(server.url))
    facts = remote.connect()
    remote.close()
    assert facts["name"] == "org/hostile" and facts["capacity"] is None and facts["parameters"] is None
    assert facts["cache"] == {"positions": 0}


@pytest.mark.parametrize(
    "mode,says",
    [
        ("redirect", "redirects (302) to 'http://elsewhere.example/v1'"),
        ("html", "not an OpenAI-compatible server: it answered text/html"),
    ],
)
def test_a_redirect_or_a_web_page_says_what_the_server_did(hostile, mode, says):
    server = hostile(mode)
    if mode == "redirect":
        with pytest.raises(RemoteError, match="redirects"):
            list_models(RemoteSpec(server.url))
        remote = RemoteSession(RemoteSpec(server.url, model="m"))
        remote.card = {"id": "m"}  # as if it had connected before the server began to redirect
        events = list(remote.generate(Request(messages=HELLO, max_new_tokens=4)))
        remote.close()
    else:
        events = reply(server, max_new_tokens=4)
    assert type(events[-1]).__name__ == "Failed" and says in events[-1].error
