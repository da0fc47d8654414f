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


BUDGET_CHAT = [{"role": "user", "content": "I am planning a trip to Chengdu. My budget is 600 yuan."}]


def edit_the_first_message(loaded, reply, make_session):
    """Two turns on BUDGET_CHAT in one session, then its first message edited (600 → 750): the session, the
    two-turn conversation, the edited reply with its PrefillStarted, and a fresh session's reply to the edit.
    `reply(session, messages=...)` -> (Finished, PrefillStarted); `make_session()` a new session."""
    session = make_session()
    first, _ = reply(session, messages=BUDGET_CHAT)
    follow = BUDGET_CHAT + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "How much?"}]
    reply(session, messages=follow)
    edited = [{"role": "user", "content": BUDGET_CHAT[0]["content"].replace("600", "750")}]
    again, start = reply(session, messages=edited)
    fresh, _ = reply(make_session(), messages=edited)
    return session, follow, (again, start), fresh
