"""The MCP servers' configuration, read as untrusted text, and the bounded stdio transport's framing, without Qt."""

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from desktop.core.mcp_stdio import CUT_CODE, CUT_KEY, MAX_MESSAGE, PREVIEW, _messages, _parse, _text_start
from desktop.core.tool_host import ToolHost
from desktop.core.tool_servers import ConfigError, read_file, read_servers


def test_the_mcpservers_shape_other_apps_write_is_read():
    text = json.dumps({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {"DEBUG": "1"}},
        "docs": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}},
        "off": {"command": "never-started", "disabled": True},
    }})  # fmt: skip
    servers = read_servers(text)
    assert sorted(servers) == ["docs", "files"]  # a disabled one is checked and not kept
    assert servers["files"].transport == "stdio" and servers["files"].env == (("DEBUG", "1"),)
    assert servers["docs"].transport == "http" and servers["docs"].describe() == "https://example.com/mcp"
    assert read_servers("") == {}


@pytest.mark.parametrize(("config", "words"), [
    ("{", "not JSON"),
    ('{"servers": {}}', '"mcpServers"'),
    ('{"mcpServers": {"a b": {"command": "x"}}}', "a name is"),
    ('{"mcpServers": {"a": {}}}', "either a command"),
    ('{"mcpServers": {"a": {"command": "x", "url": "http://h"}}}', "either a command"),
    ('{"mcpServers": {"a": {"url": "file:///etc/passwd"}}}', "http:// or https://"),
    ('{"mcpServers": {"a": {"command": "x", "args": "-v"}}}', "args must be a list"),
    ('{"mcpServers": {"a": {"command": "x", "env": {"K": 1}}}}', "must be text"),
    ('{"mcpServers": {"a": {"command": "x\\u0000y"}}}', "no NUL"),
])  # fmt: skip
def test_a_configuration_kvchat_would_not_run_is_refused_saying_where(config, words):
    with pytest.raises(ConfigError, match=words):
        read_servers(config)


def test_a_file_is_checked_before_it_is_taken(tmp_path):
    big = tmp_path / "big.json"
    big.write_text('{"mcpServers": {}, "pad": "' + "x" * 300_000 + '"}')
    with pytest.raises(ConfigError, match="at most"):
        read_file(big)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="UTF-8"):
        read_file(bad)


class _Chunks:
    """A stdout that yields the given chunks."""

    def __init__(self, chunks):
        self.chunks = chunks

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for c in self.chunks:
            yield c


def _read(chunks):
    async def go():
        return [m async for m in _messages(_Chunks(chunks))]

    return anyio.run(go)


def test_messages_are_framed_by_lines_across_chunks_and_one_past_the_limit_keeps_its_start():
    assert _read([b'{"a":', b"1}\n{", b'"b":2}\n', b"\n"]) == [b'{"a":1}', b'{"b":2}']
    head = b'{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"'
    body = b"y" * (MAX_MESSAGE + 10)
    got = _read([head, body[: len(body) // 2], body[len(body) // 2 :], b'"}]}}\n{"jsonrpc":"2.0","id":8}\n'])
    (start, size), after = got
    assert len(start) == PREVIEW and start.startswith(head) and size == len(head) + len(body) + 5
    assert after == b'{"jsonrpc":"2.0","id":8}'


def test_a_cut_message_answers_its_call_with_its_start_and_size():
    head = b'{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"ab\\ncd\\u00e9'
    cut = _parse((head + b"\\u00", 99_000_000), {7})
    assert cut.message.id == 7 and cut.message.error.code == CUT_CODE
    assert cut.message.error.data == {CUT_KEY: 99_000_000, "text": "ab\ncdé"}
    assert isinstance(_parse((head, 99_000_000), set()), ValueError)  # for no call: an error, not an answer
    assert _text_start('{"text": "a\\"b", "x": 1}') == 'a"b'


def test_a_bad_line_is_an_error_the_session_sees():
    assert isinstance(_parse(b"not json", set()), ValueError)


def test_the_host_lists_and_calls_over_stdio_and_streamable_http(tmp_path, free_tcp_port):
    """One server started as a command, one reached at a URL: both listed and called through the SDK's Client."""

    standin = Path(__file__).parent.parent / "mcp_standin.py"
    http = subprocess.Popen([sys.executable, str(standin), "--http", str(free_tcp_port)], stderr=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end:  # until it listens
            try:
                socket.create_connection(("127.0.0.1", free_tcp_port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        config = {"mcpServers": {"local": {"command": sys.executable, "args": [str(standin), str(tmp_path / "m")]},
                                 "remote": {"url": f"http://127.0.0.1:{free_tcp_port}/mcp"}}}  # fmt: skip
        host = ToolHost(read_servers(json.dumps(config)))

        async def go():
            for server in ("local", "remote"):
                tools = {t.tool.name: t for t in await host.tools(server)}
                assert {"get_weather", "hang", "big", "crash"} <= set(tools)
                assert tools["get_weather"].tool.parameters["properties"]["city"]["maxLength"] == 12
                r = await host.call(server, "get_weather", '{"city": "Oslo"}')
                assert (r.text, r.error, r.cut) == ("Oslo: 21 C, clear sky", False, False)
            bad = await host.call("local", "get_weather", "[1, 2]")
            assert bad.error and "not a JSON object" in bad.text
            missing = await host.call("nowhere", "x", "{}")
            assert missing.error and "no server named 'nowhere'" in missing.text

        asyncio.run(go())
        host.close()
    finally:
        http.kill()
        http.wait()
