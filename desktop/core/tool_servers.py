"""The MCP servers a person configured, in the `{"mcpServers": {…}}` shape Claude Desktop, Cursor and LM Studio
read: a command to start (stdio) or a URL (streamable HTTP) each. Read as untrusted text — an imported file is
someone else's — so every field is checked and bounded here; only what this returns is ever started."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

MAX_CONFIG = 256 * 1024  # bytes of a configuration (its text, or a file imported)
MAX_SERVERS = 32
MAX_ARGS = 256
MAX_FIELD = 8 * 1024  # characters of one command, argument, variable, URL or header
SERVER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ConfigError(ValueError):
    """A configuration that is not one kvchat runs: what, and where."""


@dataclasses.dataclass(frozen=True)
class ToolServer:
    """One MCP server: started as `command args` with `env` over kvchat's (stdio), or reached at `url`."""

    name: str
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str = ""
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    def describe(self) -> str:
        """What it runs, in a line: the command and its arguments, or the URL."""
        if self.url:
            return self.url
        return " ".join([self.command, *self.args])


def read_servers(text: str) -> dict[str, ToolServer]:
    """The servers of a configuration's text ("" : none); ConfigError saying what is wrong and where."""
    if not text.strip():
        return {}
    if len(text.encode()) > MAX_CONFIG:
        raise ConfigError(f"the configuration is {len(text.encode()):,} bytes: at most {MAX_CONFIG:,}")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"not JSON: {e}") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise ConfigError('it needs an object "mcpServers" holding the servers by name')
    if len(servers) > MAX_SERVERS:
        raise ConfigError(f"{len(servers)} servers: at most {MAX_SERVERS}")
    out = {name: _server(name, entry) for name, entry in servers.items()}  # each checked, the disabled too
    return {name: s for name, s in out.items() if servers[name].get("disabled") is not True}


def read_file(path: str | Path) -> str:
    """A configuration file's text, checked (size, JSON, every server) before anything takes it."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_CONFIG:
        raise ConfigError(f"{path.name} is {size:,} bytes: at most {MAX_CONFIG:,}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path.name} is not UTF-8 text") from None
    read_servers(text)
    return text


def _server(name, entry) -> ToolServer:
    where = f"server {name!r}"
    if not isinstance(name, str) or not SERVER_NAME.match(name):
        raise ConfigError(f"{where}: a name is 1-64 letters, digits, '_', '.' or '-'")
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: an object with a command or a url")
    url = entry.get("url", entry.get("serverUrl", ""))
    command = entry.get("command", "")
    if bool(url) == bool(command):
        raise ConfigError(f"{where}: either a command (stdio) or a url (streamable HTTP)")
    if url:
        url = _text(url, f"{where}: url")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{where}: the url must be http:// or https:// with a host")
        return ToolServer(name, url=url, headers=_pairs(entry.get("headers"), f"{where}: headers"))
    args = entry.get("args", [])
    if not isinstance(args, list) or len(args) > MAX_ARGS:
        raise ConfigError(f"{where}: args must be a list of at most {MAX_ARGS} strings")
    cwd = _text(entry.get("cwd", ""), f"{where}: cwd") if entry.get("cwd") else ""
    return ToolServer(
        name,
        command=_text(command, f"{where}: command"),
        args=tuple(_text(a, f"{where}: args[{i}]") for i, a in enumerate(args)),
        env=_pairs(entry.get("env"), f"{where}: env"),
        cwd=cwd,
    )


def _text(value, where: str) -> str:
    if not isinstance(value, str) or "\0" in value or len(value) > MAX_FIELD:
        raise ConfigError(f"{where} must be text (at most {MAX_FIELD:,} characters, no NUL)")
    return value


def _pairs(value, where: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_ARGS:
        raise ConfigError(f"{where} must be an object of at most {MAX_ARGS} strings")
    return tuple((_text(k, where), _text(v, f"{where}.{k}")) for k, v in value.items())


def tool_key(server: str, tool: str) -> str:
    """How a conversation names one server's tool among those it has on."""
    return f"{server}/{tool}"
