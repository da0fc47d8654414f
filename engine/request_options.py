"""The options a generating command takes for its requests (`generate`, `replay`, `chat`, `serve`): sampling, a
grammar file the reply must parse as (read and compiled before any model loads: a usage error otherwise), drafts and
the overflow policy, and the Request fields they make. Apart from engine.cli, whose commands they serve."""

from __future__ import annotations

import argparse

from .errors import EngineError
from .grammar import Grammar
from .request import OVERFLOW_POLICIES
from .sampling import SamplingParams


def sampling_args(p: argparse.ArgumentParser) -> None:
    """A generating command's sampling, its reply's shape (a grammar file) and its drafts."""
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    shaped = p.add_mutually_exclusive_group()
    shaped.add_argument("--json-schema", dest="grammar", type=grammar_file("json_schema"), default=None,
                        metavar="FILE", help="structured output: the reply is JSON that FILE, a JSON schema, "
                                             "validates")  # fmt: skip
    shaped.add_argument("--grammar", dest="grammar", type=grammar_file(None), default=None, metavar="FILE",
                        help="structured output: the reply parses as FILE, a Lark (.lark) or GBNF (.gbnf) grammar "
                             "(or a JSON schema, .json)")  # fmt: skip
    draft_args(p)


def grammar_file(kind: str | None):
    """argparse's reader of a grammar file of `kind` (None: by its name): read and compiled before any model
    loads, a usage error otherwise."""

    def read(path: str) -> Grammar:
        try:
            grammar = Grammar.from_file(path, kind)
            grammar.check()
        except EngineError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return grammar

    return read


def draft_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding's two options."""
    p.add_argument("--speculative", default=None, metavar="int4|lookup|PATH",
                   help="speculative decoding: drafts from the model itself in int4, from n-grams of the conversation "
                        "(lookup), or from a smaller model with the same tokenizer (PATH)")  # fmt: skip
    p.add_argument("--draft-tokens", type=at_least_one, default=4, metavar="K",
                   help="tokens drafted a round at most (default 4; fewer while drafts are rejected)")  # fmt: skip


def request_fields(ns) -> dict:
    """A request's speculative settings (and its grammar) from the command line."""
    return {"speculative": ns.speculative, "draft_tokens": ns.draft_tokens, "grammar": getattr(ns, "grammar", None)}


def at_least_one(text: str) -> int:
    """A count of 1 or more, as argparse reads one (a usage error otherwise)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"{n} is out of range (1 to 256)")
    return n


def overflow_arg(p: argparse.ArgumentParser, what: str = "") -> None:
    """What a prompt longer than the cache gets (`what`: the command's own words after the choices)."""
    p.add_argument(
        "--overflow",
        default="stop",
        choices=list(OVERFLOW_POLICIES),
        help="a prompt longer than the cache allows: refuse it (stop, the default), or leave out whole turns, the "
        "oldest (drop-oldest) or those after the first (truncate-middle); never the system prompt nor the last "
        "turn" + what,
    )


def sampling(ns, overrides: dict | None = None) -> SamplingParams:
    """The request's sampling from the command line, `overrides` (a replay step's own) over it."""
    o = overrides or {}
    return SamplingParams(
        temperature=o.get("temperature", ns.temperature),
        top_k=o.get("top_k", ns.top_k),
        top_p=o.get("top_p", ns.top_p),
        min_p=o.get("min_p", ns.min_p),
        repetition_penalty=o.get("repetition_penalty", ns.repetition_penalty),
        seed=o.get("seed", ns.seed),
    )
