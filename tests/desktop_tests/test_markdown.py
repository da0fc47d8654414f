"""A reply cut into text, code and thinking: what the transcript draws, and what stays open while it streams."""

from desktop.core.markdown import Piece, code_blocks, pieces

REPLY = """Here is the function:

```python
def add(a, b):
    return a + b
```

- it adds
- it returns

| a | b |
|---|---|
| 1 | 2 |
"""


def test_a_reply_is_cut_into_paragraphs_code_blocks_and_thinking():
    got = pieces("<think>\nThe user wants a function.\n</think>\n\n" + REPLY)
    assert [p.kind for p in got] == ["think", "text", "code", "text", "text"]
    assert got[0].text == "The user wants a function."
    assert got[2] == Piece("code", "def add(a, b):\n    return a + b", "python")
    assert got[3].text == "- it adds\n- it returns" and got[4].text.startswith("| a | b |")
    assert code_blocks(REPLY) == ["def add(a, b):\n    return a + b"]


def test_while_streaming_only_the_last_piece_is_open():
    half = REPLY[: REPLY.index("return")]
    got = pieces(half, streaming=True)
    assert [(p.kind, p.closed) for p in got] == [("text", True), ("code", False)]
    assert got[1].text == "def add(a, b):\n    " and got[1].lang == "python"
    assert [p.closed for p in pieces("Some words", streaming=True)] == [False]
    assert [p.closed for p in pieces("A paragraph.\n\n", streaming=True)] == [True]
    thinking = pieces("<think>\nStill going", streaming=True)
    assert thinking == [Piece("think", "Still going", closed=False)]
    assert pieces("<think>\nnever closed") == [Piece("think", "never closed")]  # a finished reply: all closed
    growing = pieces("Plan:\n- pandas\n- hot", streaming=True)  # a list's complete items are Markdown at once
    assert growing == [Piece("text", "Plan:\n- pandas"), Piece("text", "- hot", closed=False)]


def test_a_closing_fence_half_streamed_is_not_shown_as_code():
    """A reply streamed up to "`" or "``" of its closing fence: the open block holds the code alone (a CI run
    saw the block show a stray backtick line between two updates); a line that is code stays."""
    code = 'def greet(name):\n    return f"Hello, {name}!"'
    for partial in ("`", "``", "  ``"):
        got = pieces(f"```python\n{code}\n{partial}", streaming=True)
        assert got == [Piece("code", code, "python", closed=False)], partial
    for line in ("`x", "    `", "print(1)"):  # code: a backtick then more, four spaces in, or any other line
        assert pieces(f"```\n{code}\n{line}", streaming=True)[0].text == f"{code}\n{line}"
    assert pieces(f"````\n{code}\n```", streaming=True)[0].text == code  # three of a four-backtick fence
    assert pieces(f"```\n{code}\n``")[0].text == f"{code}\n``"  # a finished reply's unclosed block: all of it


def test_fences_of_either_kind_and_a_longer_closing_fence():
    got = pieces("~~~\nplain\n~~~\nafter\n````js\nlet x = '```';\n````")
    assert [(p.kind, p.text, p.lang) for p in got] == [
        ("code", "plain", ""),
        ("text", "after", ""),
        ("code", "let x = '```';", "js"),
    ]
