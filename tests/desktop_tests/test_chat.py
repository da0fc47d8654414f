"""The chat controller without Qt or a model: a fake client plays the engine's events, the way the
anchors test their engines with a mock model. Send, edit, regenerate, continue, stop reasons,
partial saves, token counts and failures, each read back from the store and the listener."""

import asyncio
import dataclasses

import pytest

from desktop.core.chat import ChatController
from desktop.core.replies import Accounting, ReplyStats
from desktop.core.settings import Settings
from desktop.core.store import Store
from engine.events import Failed, Finished, PrefillDone, PrefillStarted, ReuseReport, Token


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FakeClient:
    """Replies with `words`, one Token event per word, 10 ms apart on the fake clock; the last event is
    Finished with `reason` (or Failed with `error`)."""

    def __init__(self, clock, words=("Hello", " there"), reason="eos", error=None, batches=1):
        self.clock, self.words, self.reason, self.error, self.batches = clock, list(words), reason, error, batches
        self.requests, self.stopped, self.stopped_requests = [], 0, []

    async def stream(self, request):
        self.requests.append(request)
        n_prompt = len(request.messages)
        reuse = ReuseReport(2, n_prompt, 0, None, None, None, None)
        events = [
            PrefillStarted(n_prompt + 2, reuse, tuple(range(n_prompt + 2))),
            PrefillDone(2, n_prompt, 0.01, n_prompt + 2),
        ]
        times = [self.clock.t + 0.01 * (i + 1) for i in range(len(self.words))]  # the clock reaches each as it is sent
        for i, (w, t) in enumerate(zip(self.words, times)):
            events.append(Token(i + 1, 100 + i, w, t, n_prompt + 2 + i))
        if self.error:
            events.append(Failed(self.error, "CapacityError", {"status": "failed"}, {"positions": 3}))
        else:
            trace = {"tokens": len(times), "ttft_ms": round((times[0] - request.arrival) * 1000, 6)}
            events.append(
                Finished(
                    self.reason,
                    "".join(self.words),
                    tuple(range(len(times))),
                    trace,
                    {"positions": n_prompt + 1 + len(times)},
                    reuse,
                )
            )
        events.append(Accounting(tuple(7 + i for i in range(len(request.messages))), {"requests": len(self.requests)}))
        step = max(1, len(events) // self.batches)
        for i in range(0, len(events), step):
            batch = tuple(events[i : i + step])
            self.clock.t = max([self.clock.t] + [e.time for e in batch if isinstance(e, Token)])
            await asyncio.sleep(0)
            yield batch

    def stop(self, request=None):
        self.stopped += 1
        self.stopped_requests.append(request)


class Listener:
    def __init__(self):
        self.calls, self.errors, self.finals = [], [], []

    def transcript_changed(self):
        self.calls.append("transcript")

    def reply_progressed(self):
        self.calls.append("progress")

    def first_token(self):
        self.calls.append("first")

    def reply_finished(self, final, highlight):
        self.calls.append("finished")
        self.finals.append((final, highlight))

    def show_error(self, text):
        self.errors.append(text)


@pytest.fixture
def chat(tmp_path):
    clock = Clock()
    store = Store(tmp_path / "chat.db")
    ctl = ChatController(store, FakeClient(clock), Settings(system_prompt="Be brief."), Listener(), clock)
    yield ctl
    store.close()


def run(coro):
    return asyncio.run(coro)


def say(chat, text):
    mid = chat.send(text, chat.clock())
    run(chat.reply(mid, chat.clock() - 0.05))
    return mid


def test_send_stores_both_messages_and_builds_the_request(chat):
    mid = say(chat, "  Plan a trip  ")
    user, reply = chat.branch()
    assert (user.id, user.role, user.content) == (mid, "user", "Plan a trip")
    assert (reply.role, reply.content, reply.status, reply.parent_id) == ("assistant", "Hello there", "complete", mid)
    assert chat.store.conversation(chat.current_cid).title == "Plan a trip"
    req = chat.client.requests[0]
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Plan a trip"}]
    assert req.max_new_tokens == chat.settings.max_new_tokens and req.sampling.temperature == 0.0
    assert chat.listener.calls[0] == "transcript" and chat.listener.calls[-2:] == ["transcript", "finished"]
    assert "progress" in chat.listener.calls and not chat.generating and chat.streaming_mid is None
    assert chat.listener.calls.count("first") == 1  # token 1 is drawn at once, once
    assert reply.trace["status"] == "complete" and reply.trace["reason"] == "eos"
    assert chat.stats.tokens == 2 and chat.stats.title == "Reply · stop token"


def test_figures_while_streaming_come_from_the_one_place(chat):
    """Live, before the engine's final trace, the panel's figures are engine.trace's own."""
    s = ReplyStats(arrival=10.0, token_times=[10.5, 10.6, 10.8])
    assert s.figure("ttft_ms") == 500.0 and s.figure("tpot_ms") == pytest.approx(150.0)
    assert s.figure("decode_tok_s") == pytest.approx(1000 / 150) and s.figure("e2e_ms") == pytest.approx(800.0)
    assert ReplyStats(arrival=10.0, token_times=[10.5]).figure("tpot_ms") is None  # missing, never 0
    s.trace = {"ttft_ms": 1.0, "tokens": 9}
    assert s.figure("ttft_ms") == 1.0 and s.tokens == 9


def test_stop_reasons_become_statuses_and_continue_extends_the_reply(chat):
    chat.client.reason = "max_new_tokens"
    say(chat, "Tell me more")
    reply = chat.last_message()
    assert reply.status == "length" and chat.can_continue() and chat.can_regenerate()
    chat.client.words, chat.client.reason = [" and more"], "eos"
    run(chat.reply(reply.parent_id, chat.clock(), continue_mid=reply.id))
    req = chat.client.requests[-1]
    assert req.continue_final_message and not req.add_generation_prompt
    assert req.messages[-1] == {"role": "assistant", "content": "Hello there"}
    last = chat.last_message()
    assert last.content == "Hello there and more" and last.status == "complete" and last.id != reply.id
    assert [m.id for m in chat.store.siblings(last)] == [reply.id, last.id]  # the old reply stays a branch


@pytest.mark.parametrize(
    "reason,status", [("cancelled", "stopped"), ("capacity", "length"), ("stop_string", "complete")]
)
def test_each_stop_reason_has_its_status(chat, reason, status):
    chat.client.reason = reason
    say(chat, "Hi")
    assert chat.last_message().status == status


def test_an_edit_branches_regenerates_and_marks_the_changed_character(chat):
    first = say(chat, "My budget is 600 yuan.")
    new = chat.edit(first, "My budget is 750 yuan.")
    assert new is not None and new != first
    user = chat.store.message(new)
    assert user.parent_id is None and [m.id for m in chat.store.siblings(user)] == [first, new]
    reuse = ReuseReport(13, 5, 7, 13, {"id": 1, "text": "6"}, {"id": 2, "text": "7"}, "differs")

    async def stream(request, orig=chat.client.stream):  # the engine's report of an edit at position 13
        async for batch in orig(request):
            yield tuple(
                dataclasses.replace(e, reuse=reuse) if isinstance(e, (PrefillStarted, Finished)) else e for e in batch
            )

    chat.client.stream = stream
    run(chat.reply(new, chat.clock()))
    assert chat.client.requests[-1].messages[-1]["content"] == "My budget is 750 yuan."
    final, highlight = chat.listener.finals[-1]
    assert highlight == (new, 13, 14)  # the message, its first changed character, the end of the new token
    assert chat.stats.reuse["first_invalidated_position"] == 13


def test_editing_a_reply_only_branches(chat):
    say(chat, "Hi")
    reply = chat.last_message()
    assert chat.edit(reply.id, "A better answer") is None
    assert chat.last_message().content == "A better answer" and len(chat.client.requests) == 1


def test_regenerate_and_branch_switching(chat):
    say(chat, "Hi")
    first_reply = chat.last_message()
    chat.client.words = ["Other"]
    run(chat.reply(chat.regenerate_target(), chat.clock()))
    second = chat.last_message()
    assert second.content == "Other" and second.parent_id == first_reply.parent_id
    assert chat.switch_branch(second.id, -1) and chat.last_message().id == first_reply.id
    assert not chat.switch_branch(first_reply.id, -1)  # nothing before the first


def test_partial_replies_are_saved_while_streaming(chat):
    saved = []
    update = chat.store.update_message

    def spy(mid, **kw):
        saved.append((mid, kw.get("content"), kw.get("status")))
        return update(mid, **kw)

    chat.store.update_message = spy
    chat.client.words = [f"w{i} " for i in range(60)]  # 0.6 s of tokens on the fake clock
    chat.client.batches = 30
    say(chat, "Long one")
    partial = [c for _, c, st in saved if st is None and c]
    assert partial and all(c.startswith("w0 ") for c in partial) and partial[0] != partial[-1]


def test_token_counts_and_the_session_summary_arrive_after_the_reply(chat):
    say(chat, "Count me")
    user = chat.branch()[0]
    assert user.token_count == 8  # the second message of the request (the system prompt is the first)
    assert chat.summary == {"requests": 1}


def test_a_failed_reply_keeps_its_text_and_says_why(chat):
    chat.client.error = "the prompt has 99 tokens but the KV cache holds only 64 positions"
    say(chat, "Too long")
    reply = chat.last_message()
    assert reply.status == "failed" and reply.content == "Hello there"
    assert chat.listener.errors == [f"The reply failed: {chat.client.error}"]
    assert isinstance(chat.listener.finals[-1][0], Failed) and chat.stats.status == "failed"


def test_a_stream_that_ends_without_a_last_event_fails_cleanly(chat):
    async def cut(request):
        yield (PrefillStarted(3, ReuseReport(0, 3, 0, None, None, None, None), (1, 2, 3)),)

    chat.client.stream = cut
    say(chat, "Hi")
    assert chat.last_message().status == "failed" and "stopped before the reply ended" in chat.listener.errors[0]
    assert not chat.generating


def test_a_locked_database_is_a_message_not_a_crash(chat):
    from desktop.core.store_file import StoreError

    def locked(*a, **k):
        raise StoreError("the conversation database is locked by another program; your last change was not saved")

    chat.store.add_message = locked
    assert chat.send("Hi", chat.clock()) is None
    assert "locked" in chat.listener.errors[0]


def test_closing_mid_reply_keeps_what_streamed(chat):
    mid = chat.send("Hi", chat.clock())
    chat.client.batches = 4

    async def close_midway():
        task = asyncio.ensure_future(chat.reply(mid, chat.clock()))
        while not chat.stream_text:
            await asyncio.sleep(0)
        chat.save_partial()
        task.cancel()
        return chat.streaming_mid

    streaming = run(close_midway())
    m = chat.store.message(streaming)
    assert m.status == "stopped" and m.content == chat.stream_text and chat.client.stopped == 1


class FakeQSettings(dict):
    def contains(self, key):
        return key in self

    def value(self, key):
        return self[key]

    def setValue(self, key, value):
        self[key] = str(value)  # an ini file keeps text

    def sync(self):
        pass


def test_settings_keep_one_load_spec_and_read_the_files_kvchat_always_wrote():
    from engine.spec import LoadSpec

    qs = FakeQSettings()
    s = Settings(
        model=LoadSpec(path="/m", dtype="bfloat16", capacity=512, weights="int4", group_size=32),
        temperature=0.7,
        seed=3,
    )
    s.save(qs)
    assert qs["model_dir"] == "/m" and qs["device"] == "auto" and qs["capacity"] == "512"
    assert Settings.load(qs) == s
    legacy = FakeQSettings(
        model_dir="",
        device="auto",
        dtype="float16",
        capacity="0",
        weights="none",
        kv="int8",
        group_size="64",
        temperature="x",
    )  # a bad value keeps the default
    got = Settings.load(legacy)
    assert got.model == LoadSpec(path=None, device=None, dtype="float16", capacity=None, kv="int8")
    assert got.temperature == 0.0


def test_two_clicks_in_one_turn_start_one_reply(chat):
    mid = chat.send("Hi", chat.clock())
    first, second = chat.start(mid, chat.clock()), chat.start(mid, chat.clock())
    assert first is not None and second is None and chat.generating
    run(first)
    assert len(chat.client.requests) == 1 and not chat.generating
    assert len(chat.store.siblings(chat.last_message())) == 1


def test_a_reply_stays_in_its_conversation_while_another_is_opened(chat):
    say(chat, "In A")
    a = chat.current_cid
    chat.client.batches = 6
    mid = chat.send("Second in A", chat.clock())

    async def switch_midway():
        task = asyncio.ensure_future(chat.start(mid, chat.clock()))  # as the window starts it: at once
        while chat.streaming_mid is None or not chat.stream_text:
            await asyncio.sleep(0)
        b = chat.store.new_conversation("B")
        chat.current_cid = b.id  # the person opens B while A's reply streams
        await task
        return b.id

    b = run(switch_midway())
    assert [m.content for m in chat.store.branch(a)][-2:] == ["Second in A", "Hello there"]
    assert chat.store.branch(b) == [] and chat.current_cid == b
    say(chat, "In B")  # the next message goes where the person is
    assert [m.content for m in chat.store.branch(b)] == ["In B", "Hello there"]


def test_the_first_text_is_saved_at_once(chat):
    saved = []
    update = chat.store.update_message
    chat.store.update_message = lambda mid, **kw: (saved.append(kw.get("content")), update(mid, **kw))[1]
    chat.client.words = ["first", " second", " third"]
    chat.client.batches = 6  # one token a batch, all within one save interval on the fake clock
    say(chat, "Hi")
    assert saved[0] == "first"  # a crash after the first token loses nothing shown


def test_every_state_a_crash_leaves_can_be_resumed(chat):
    orphan = chat.send("Hi", chat.clock())  # the app died right after Send: no reply at all
    assert chat.can_regenerate() and chat.regenerate_target() == orphan
    run(chat.reply(chat.regenerate_target(), chat.clock()))
    assert chat.last_message().parent_id == orphan
    empty = chat.store.add_message(chat.current_cid, orphan, "assistant", "", status="incomplete")
    assert chat.last_message().id == empty.id and chat.can_continue()
    assert chat.continue_target() == (orphan, None)  # nothing to extend: answered afresh


def test_each_request_is_labelled_with_its_conversation_and_branch(chat):
    """The prefix store's picture names prompts by conversation and branch (reuse itself is by tokens);
    the reply's saved record keeps its cache figures but not the store's picture, which is the session's."""
    first = say(chat, "My budget is 600 yuan.")
    assert chat.client.requests[-1].label == "My budget is 600 yuan."
    new = chat.edit(first, "My budget is 750 yuan.")
    run(chat.reply(new, chat.clock()))
    assert chat.client.requests[-1].label == "My budget is 600 yuan. ‹2/2›"
    store = {"bytes": 10, "budget": 100, "tree": [{"label": "x"}]}

    async def stream(request, orig=chat.client.stream):  # the engine's cache figures carry the store
        async for batch in orig(request):
            yield tuple(
                dataclasses.replace(e, cache={**e.cache, "store": store}) if isinstance(e, Finished) else e
                for e in batch
            )

    chat.client.stream = stream
    chat.new_conversation()
    say(chat, "Another trip")
    assert chat.client.requests[-1].label == "Another trip"
    assert chat.store_state == store  # the panel shows the session's store...
    saved = chat.store.message(chat.last_message().id)
    assert saved.trace["cache"] == {"positions": 5}  # ...and the saved reply keeps its own figures


def test_a_second_conversation_sends_while_the_first_streams_and_stop_is_its_own(chat):
    """Replies in two conversations stream at once; Stop in the one shown stops its own reply alone."""
    chat.client.batches = 6
    a_mid = chat.send("In A", chat.clock())
    a = chat.current_cid

    async def both():
        first = asyncio.ensure_future(chat.start(a_mid, chat.clock()))
        while not chat.stream_text:
            await asyncio.sleep(0)
        assert chat.generating and chat.new_conversation()  # a new conversation, while A streams
        assert not chat.generating and chat.busy  # B takes a Send; a reply streams elsewhere
        b_mid = chat.send("In B", chat.clock())
        second = chat.start(b_mid, chat.clock())
        assert second is not None and chat.start(b_mid, chat.clock()) is None  # one reply a conversation
        second = asyncio.ensure_future(second)
        while len(chat.streams) < 2:
            await asyncio.sleep(0)
        assert {st.cid for st in chat.streams.values()} == {a, chat.current_cid}
        chat.stop()
        await asyncio.gather(first, second)
        return chat.current_cid

    b = run(both())
    assert chat.client.stopped_requests == [chat.client.requests[1]]  # B's request, not A's
    assert not chat.busy and not chat.runs and not chat.streams
    assert [m.content for m in chat.store.branch(a)] == ["In A", "Hello there"]
    assert [m.content for m in chat.store.branch(b)] == ["In B", "Hello there"]


def test_alternatives_are_one_prompt_n_seeds_the_first_sharing_its_prefill(chat):
    import dataclasses

    chat.settings = dataclasses.replace(chat.settings, temperature=0.7, seed=5)
    mid = say(chat, "Hi")
    run(chat.start(mid, chat.clock(), alternatives=3))
    reqs = chat.client.requests[1:]
    assert [r.sampling.seed for r in reqs] == [5, 6, 7] and [r.share_prompt for r in reqs] == [True, False, False]
    assert len({tuple(map(str, r.messages)) for r in reqs}) == 1  # one prompt
    replies = [m for m in chat.store.siblings(chat.last_message()) if m.role == "assistant"]
    assert len(replies) == 4 and chat.last_message().id == replies[1].id  # the first alternative shown
    assert not chat.busy and not chat.runs
