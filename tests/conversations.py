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


TRIP = [{"role": "user", "content": "I am planning a trip to Chengdu for 3 nights, on a budget of 600 yuan, with two "
                                    "friends who like tea houses and long walks."}]  # fmt: skip


def edit_back_to_a_snapshot(loaded, reply, make_session, layers: str) -> None:
    """A scanning hybrid's edit: TRIP answered, then its words changed midway. The edit goes back to the last
    snapshot before the changed position (the reason names `layers`, e.g. "3 Mamba-2 layers", and the spacing) and
    replies as a fresh session does; the first branch again comes from the prefix store, up to a snapshot past the
    edit, and replies as a fresh session does."""
    session = make_session()
    reply(session, messages=TRIP, max_new_tokens=40)
    edited = [{"role": "user", "content": TRIP[0]["content"].replace("tea houses", "opera nights")}]
    done, start = reply(session, messages=edited)
    r = start.reuse
    cut, every = r.first_invalidated_position, session.facts()["state"]["every"]
    assert r.reused == cut // every * every < cut and r.source == "working"
    assert f"the {layers} keep their state, and a snapshot of it every {every} positions" in r.reason
    assert done.token_ids == reply(make_session(), messages=edited)[0].token_ids
    back, start = reply(session, messages=TRIP)  # the first branch again: its blocks, the snapshots with them
    assert start.reuse.source == "store" and start.reuse.reused % every == 0 and start.reuse.reused > cut
    assert back.token_ids == reply(make_session(), messages=TRIP)[0].token_ids
