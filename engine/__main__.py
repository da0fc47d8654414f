"""`python -m engine` and `kvchat-engine`: the engine's commands (engine.cli) and its tools'
(bench, quality, selftest in engine.tools), the one place where the two meet."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .tools import TOOLS

    if argv and argv[0] in TOOLS:
        from .tools import run_tool

        return run_tool(argv[0], argv[1:])
    from .cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
