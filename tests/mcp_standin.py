"""An MCP server written with the official SDK (MCPServer, stdio), for the tool tests: a tool that answers, one
that marks a file when it runs (so a test can see a denied call never ran), one that hangs, one whose result is
50 MB, and one that makes the server exit mid-call. Run as `python mcp_standin.py MARK_FILE` (stdio) or
`python mcp_standin.py --http PORT`."""

import os
import sys
import time
from pathlib import Path
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

MARK = Path(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "--http" else None
app = MCPServer("standin")


@app.tool()
def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
    """The weather in a city now."""
    if MARK is not None:
        MARK.write_text(city)
    return f"{city}: 21 C, clear sky"


@app.tool()
def hang() -> str:
    """Never answers."""
    time.sleep(3600)
    return ""


@app.tool()
def big() -> str:
    """A result of 50 MB."""
    return "x" * 50_000_000


@app.tool()
def crash() -> str:
    """The server exits mid-call."""
    print("standin: exiting on purpose", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:  # `--http PORT`: streamable HTTP on 127.0.0.1:PORT/mcp
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run("stdio")
