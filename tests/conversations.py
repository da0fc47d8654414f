"""Conversations the tests share: one that grows a turn at a time past any small capacity."""

SYSTEM = {"role": "system", "content": "You plan trips on a budget."}


def question(i: int) -> dict:
    return {"role": "user", "content": f"Question {i}: what should I eat in Chengdu on {i * 100} yuan?"}


def answer(i: int) -> dict:
    return {"role": "assistant", "content": f"Answer {i}: hotpot, noodles and dumplings from stalls."}


def long_conversation(turns: int, last: str | None = "And for 750 yuan?") -> list[dict]:
    """The system prompt, `turns` questions with their answers, then `last` (a user message) if given."""
    msgs = [SYSTEM]
    for i in range(turns):
        msgs += [question(i), answer(i)]
    return msgs + ([{"role": "user", "content": last}] if last else [])
