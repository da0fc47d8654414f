"""The chat logic without Qt: send, edit, regenerate, continue and branch switching over the
conversation store, the request each builds, and what each engine event does to the reply.

The window drives a ChatController and shows what it holds; tests drive it with a fake client.
The controller talks back through a listener (the window) with four calls: the transcript
changed, the reply progressed, the reply finished, an error to show.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.events import Failed, Finished, PrefillStarted, Token
from engine.logprobs import MAX_TOP_LOGPROBS
from engine.session import Request

from .cache_map import CacheMap
from .replies import (
    CONTINUABLE,
    STATUS_BY_REASON,
    Accounting,
    Fork,
    ReplyStats,
    branch_mark,
    first_difference,
    left_out,
    made_by,
    model_words,
    title_from,
)
from .settings import Settings
from .store import Message, Store
from .store_file import StoreError

SAVE_EVERY_S = 0.25  # partial replies reach the database this often while streaming


class Client(Protocol):
    """Where replies come from: the worker thread (desktop.client) or, in tests, a fake."""

    def stream(self, request: Request) -> AsyncIterator[tuple]: ...

    def stop(self) -> None: ...


class Listener(Protocol):
    def transcript_changed(self) -> None: ...

    def reply_progressed(self) -> None: ...

    def first_token(self) -> None: ...

    def reply_finished(self, final, highlight: tuple[int, int, int] | None) -> None: ...

    def show_error(self, text: str) -> None: ...


class ChatController:
    """One conversation at a time over the store; at most one reply streaming."""

    def __init__(self, store: Store, client: Client, settings: Settings, listener: Listener, clock):
        self.store, self.client, self.settings, self.listener, self.clock = store, client, settings, listener, clock
        self.current_cid: int | None = None
        self.generating = False
        self.streaming_mid: int | None = None
        self.stream_text = ""  # the streaming reply's text so far
        self.stats = ReplyStats()  # the reply the panel shows
        self.engine_facts: dict | None = None  # the engine and model in use (the window's, once loaded)
        self.stats_by_message: dict[int, ReplyStats] = {}
        self.selected_mid: int | None = None
        self.summary: dict | None = None  # the session's figures after the last reply
        self.store_state: dict | None = None  # the prefix store after the last reply or probe
        self._edit: tuple[int, int] | None = None  # (new message id, first changed character) of an edit
        self.cache_map = CacheMap()  # the KV cache now: what each position holds and where it came from

    # --- the store, guarded --------------------------------------------------------------------
    def guard(self, fn, *args, **kw):
        """Run a store call; a locked or failing database becomes a message, not a crash."""
        try:
            return fn(*args, **kw)
        except StoreError as e:
            self.listener.show_error(str(e))
            return None

    def branch(self) -> list[Message]:
        return self.store.branch(self.current_cid) if self.current_cid is not None else []

    def rows(self) -> list[tuple[Message, int, int]]:
        """The current branch as (message, its index among its siblings, how many siblings)."""
        if self.current_cid is None:
            return []
        versions = self.store.versions(self.current_cid)
        return [(m, *versions[m.id]) for m in self.branch()]

    def last_message(self) -> Message | None:
        """The branch's last message, without its record (its leaf: one read, however long the conversation)."""
        if self.current_cid is None:
            return None
        leaf = self.store.conversation(self.current_cid).leaf_id
        return None if leaf is None else self.store.head(leaf)

    def can_regenerate(self) -> bool:
        """A reply can be run again, or run at all for a user message left without one (a crash right
        after Send)."""
        last = self.last_message()
        return not self.generating and last is not None and last.role in ("assistant", "user")

    def can_continue(self) -> bool:
        last = self.last_message()
        return self.can_regenerate() and last.role == "assistant" and last.status in CONTINUABLE

    # --- conversations -------------------------------------------------------------------------
    def new_conversation(self) -> bool:
        if self.generating:
            return False
        conv = self.guard(self.store.new_conversation, "New chat", self.settings.conversation_part())
        if conv is None:
            return False
        self.current_cid = conv.id
        return True

    def switch_branch(self, mid: int, delta: int) -> bool:
        """Show the sibling `delta` away from message `mid` (‹ ›), down to that branch's newest leaf."""
        if self.generating:
            return False
        sibs = self.store.siblings(self.store.message(mid))
        i = next(k for k, s in enumerate(sibs) if s.id == mid) + delta
        if not 0 <= i < len(sibs):
            return False
        self.guard(self.store.set_leaf, self.current_cid, self.store.deepest_leaf(sibs[i].id))
        return True

    def reveal(self, mid: int) -> bool:
        """Show a branch that holds message `mid` (a search's match on another branch), down to that
        branch's newest leaf; False when the branch shown holds it already."""
        if self.current_cid is None or any(m.id == mid for m in self.branch()):
            return False
        self.guard(self.store.set_leaf, self.current_cid, self.store.deepest_leaf(mid))
        return True

    def select_message(self, mid: int, wait: bool = True) -> ReplyStats | None:
        """The stats of a reply (live, or from its stored trace) become the panel's; with `wait` False, None
        while the store reads a big record on a thread (Store.message)."""
        self.selected_mid = mid
        st = self.stats_by_message.get(mid)
        if st is None:
            m = self.store.message(mid, wait)
            if m is not None and m.trace:
                st = self.stats_by_message[mid] = ReplyStats.from_record(m.trace, m.status)
        if st is not None:
            self.stats = st
        return st

    def follow_shown(self, mid: int | None) -> bool:
        """The panel describes the reply on screen: `mid`, the last reply of the branch shown (None: it has
        none), unless the reply streaming now is one of the branch's messages. Its own figures (live, or
        stored with it), or none at all ("No reply yet"); never another reply's. True when that changed
        what the panel shows."""
        if self.streaming_mid is not None and self.streaming_mid == mid:
            return False
        if mid is not None and mid == self.selected_mid and self.stats is self.stats_by_message.get(mid):
            return False
        if mid is not None and self.select_message(mid, wait=False) is not None:
            return True
        changed = self.stats.status != "idle" or self.selected_mid != mid
        self.selected_mid, self.stats = mid, ReplyStats()  # a reply with no figures (an import), or no reply
        return changed

    # --- requests ------------------------------------------------------------------------------
    def settings_for(self, cid: int | None = None) -> Settings:
        """The app's settings with the conversation's own system prompt and sampling over them."""
        cid = self.current_cid if cid is None else cid
        own = self.store.conversation(cid).settings if cid is not None else None
        return self.settings.with_conversation(own)

    def messages(self, upto: list[Message], cid: int | None = None) -> list[dict]:
        """What the model sees: the conversation's system prompt, then the messages of the branch up to here."""
        prompt = self.settings_for(cid).system_prompt
        system = [{"role": "system", "content": prompt}] if prompt else []
        return system + [{"role": m.role, "content": m.content} for m in upto]

    def request(self, messages: list[dict], arrival: float, cid: int | None = None, **kw) -> Request:
        s = self.settings_for(cid)
        top = max(0, min(MAX_TOP_LOGPROBS, s.token_alternatives))
        return Request(messages=messages, sampling=s.sampling(), max_new_tokens=s.max_new_tokens, arrival=arrival,
                       logprobs=True, top_logprobs=top, overflow=s.policy, **kw)  # fmt: skip

    def label(self, cid: int, upto: list[Message]) -> str:
        """A name for a prompt in the prefix store's picture: the conversation's title, and the branch
        (‹2/3›) of the deepest edited message on the way, if any."""
        title = self.store.conversation(cid).title
        mark = branch_mark(self.store.versions(cid), upto)
        return f"{title} {mark}" if mark else title

    def messages_until(self, mid: int) -> list[Message]:
        """The current branch from the root to message `mid`, included."""
        path = self.branch()
        return path[: next(i for i, m in enumerate(path) if m.id == mid) + 1]

    # --- what a person does --------------------------------------------------------------------
    def send(self, text: str, arrival: float) -> int | None:
        """A new user message on the current branch (a new conversation if none); returns its id, whose
        reply the caller then runs (`reply`)."""
        text = text.strip()
        if not text or self.generating:
            return None
        if self.current_cid is None:
            conv = self.guard(self.store.new_conversation, title_from(text), self.settings.conversation_part())
            if conv is None:
                return None
            self.current_cid = conv.id
        else:
            conv = self.store.conversation(self.current_cid)
            if conv.title == "New chat":
                self.guard(self.store.rename, conv.id, title_from(text))
        user = self.guard(self.store.add_message, self.current_cid, conv.leaf_id, "user", text)
        return None if user is None else user.id

    def edit(self, mid: int, text: str) -> int | None:
        """An edit makes a sibling branch. Returns the new user message's id when its reply must be
        regenerated (through prefix reuse), else None."""
        if self.generating:
            return None
        old = self.store.message(mid)
        new = self.guard(self.store.add_message, self.current_cid, old.parent_id, old.role, text)
        if new is None:
            return None
        self._edit = (new.id, first_difference(old.content, text))
        return new.id if old.role == "user" else None

    def regenerate_target(self) -> int | None:
        """The user message whose reply Regenerate runs (again)."""
        if not self.can_regenerate():
            return None
        last = self.last_message()
        return last.id if last.role == "user" else last.parent_id

    def continue_target(self) -> tuple[int, int | None] | None:
        """(the user message, the reply to extend) for Continue; a reply that stopped before its first
        token has nothing to extend, so it is answered afresh."""
        if not self.can_continue():
            return None
        last = self.last_message()
        return last.parent_id, (last.id if last.content else None)

    def stop(self) -> None:
        self.client.stop()

    def fork_target(self, mid: int, index: int, token: dict | None) -> Fork | None:
        """A fork of reply `mid` at its token `index`: the new branch keeps the tokens before it and goes on
        with `token` (one of that step's alternatives) or, None, a token drawn again there."""
        if self.generating:
            return None
        m = self.store.message(mid)
        steps = (m.trace or {}).get("tokens") if isinstance(m.trace, dict) else None
        if m.role != "assistant" or not isinstance(steps, list) or not 0 <= index < len(steps):
            return None
        return Fork(mid, index, token)

    def start(self, parent_id: int, arrival: float, continue_mid: int | None = None, fork: Fork | None = None):
        """Claim the one reply slot at once and return the coroutine that streams the reply to message
        `parent_id` (or extends reply `continue_mid`); None when a reply is already running, so that
        two clicks in one event-loop turn start one reply. The reply stays in this conversation
        whatever the person opens while it streams."""
        if self.generating:
            return None
        self.generating = True
        return self._run(self.current_cid, self.messages_until(parent_id), parent_id, arrival, continue_mid, fork)

    async def reply(self, parent_id: int, arrival: float, continue_mid: int | None = None) -> None:
        """start() and wait for the reply to end."""
        run = self.start(parent_id, arrival, continue_mid)
        if run is not None:
            await run

    async def _run(self, cid, upto, parent_id, arrival, continue_mid, fork=None) -> None:
        try:
            await self._reply(cid, upto, parent_id, arrival, continue_mid, fork)
        finally:
            self.generating = False
            self.streaming_mid = None

    async def _reply(self, cid: int, upto: list[Message], parent_id: int, arrival: float, continue_mid, fork=None):
        carried: list[dict] = []  # a fork's tokens before it (and the token it forks with)
        if fork is not None:
            req, prefix, carried = self._fork_request(cid, upto, arrival, fork)
            old_tokens = len(carried)
        elif continue_mid is not None:
            base = self.store.message(continue_mid)
            prefix, old_tokens = base.content, base.token_count or 0
            req = self.request(
                self.messages(upto, cid) + [{"role": "assistant", "content": prefix}],
                arrival,
                cid,
                continue_final_message=True,
                add_generation_prompt=False,
                label=self.label(cid, upto),
            )
        else:
            prefix, old_tokens = "", 0
            req = self.request(self.messages(upto, cid), arrival, cid, label=self.label(cid, upto))
        assistant = self.store.add_message(cid, parent_id, "assistant", prefix, status="streaming")
        self.streaming_mid = assistant.id
        self.stream_text = prefix
        stats = self.stats = self.stats_by_message[assistant.id] = ReplyStats(
            arrival=arrival, status="prefill", made_by=made_by(self.engine_facts), steps=carried, carried=old_tokens
        )  # its own: the panel may show another reply meanwhile (another conversation opened)
        self.selected_mid = assistant.id
        title = self.store.conversation(cid).title
        self.cache_map.start(req.messages or [], len(req.reply_ids), f"the reply to “{title}”, message {len(upto) + 1}")
        self.listener.transcript_changed()
        highlight, self._edit = self._edit, None
        text, saved, last_save, final = prefix, prefix, self.clock(), None
        async for batch in self.client.stream(req):
            first = False
            for ev in batch:
                if isinstance(ev, Accounting):
                    self._count_tokens(upto, ev)
                    continue
                if isinstance(ev, PrefillStarted) and ev.reply_prefix and fork is not None and text == prefix:
                    text = self._forked_prefix(ev.reply_prefix, carried, fork)  # the engine's own decode of it
                    prefix = saved = text
                text += stats.apply(ev)
                self.cache_map.apply(ev)
                first = first or (isinstance(ev, Token) and ev.index == 1)
                if isinstance(ev, (Finished, Failed)):
                    final = ev
                    self.store_state = (ev.cache or {}).get("store", self.store_state)
            self.stream_text = text
            # The first text at once (a crash in the first interval must not lose it), then every interval.
            if final is None and text != saved and (saved == prefix or self.clock() - last_save >= SAVE_EVERY_S):
                saved = text
                self.guard(self.store.update_message, assistant.id, content=text, token_count=old_tokens + stats.tokens)
                last_save = self.clock()
            if first:
                self.listener.first_token()  # drawn at once, not at the next refresh tick
            self.listener.reply_progressed()
        if final is None:  # the stream ended without a last event: the worker went away
            final = Failed("the engine stopped before the reply ended", "EngineError", {})
            stats.apply(final)
        status = STATUS_BY_REASON.get(final.reason, "failed") if isinstance(final, Finished) else "failed"
        if isinstance(final, Finished):
            text = prefix + final.text
        record = {
            "on_screen_ms": stats.on_screen_ms,
            "status": status,
            "reason": getattr(final, "reason", None),
            "trace": final.trace,
            "reuse": stats.reuse,
            "cache": {k: v for k, v in (final.cache or {}).items() if k != "store"},  # the store's picture is now's
            "error": stats.error,
            "made_by": stats.made_by,
            "tokens": stats.steps,
            "tokens_reported": stats.steps_reported,
            "carried_tokens": old_tokens,
            "left_out": left_out(req.messages or (), upto, stats.reuse),
        }
        self.guard(
            self.store.update_message,
            assistant.id,
            content=text,
            status=status,
            token_count=old_tokens + stats.tokens,
            trace=record,
        )
        if isinstance(final, Failed):
            self.listener.show_error(f"The reply failed: {final.error}")
        self.stream_text = text
        self.generating, self.streaming_mid = False, None
        self.listener.transcript_changed()
        mark = None
        reuse = stats.reuse or {}
        if highlight and reuse.get("first_invalidated_position") is not None:
            width = len((reuse.get("new_token") or {}).get("text", "").strip()) or 1
            mark = (highlight[0], highlight[1], highlight[1] + width)  # (message, first, end character)
        self.listener.reply_finished(final, mark)

    def _fork_request(self, cid: int, upto: list[Message], arrival: float, fork: Fork):
        """(the request, the reply's text so far, its tokens so far) of a fork. A local engine is given the
        token ids, so that every position before the fork is reused and the fork's token alone computed; a
        remote one, which takes only messages, the text to continue."""
        steps = self.store.message(fork.mid).trace["tokens"]
        kept = [dict(s) for s in steps[: fork.index]]
        carried = list(kept)
        if fork.token is not None:
            at = steps[fork.index]
            top = at.get("top") or []
            place = next((k for k, a in enumerate(top) if a.get("token_id") == fork.token.get("token_id")), None)
            carried.append({
                "shown": str(fork.token.get("text", "")), "token_id": fork.token.get("token_id", -1),
                "text": str(fork.token.get("text", "")), "logprob": fork.token.get("logprob"),
                "sampled_logprob": fork.token.get("sampled_logprob"), "entropy": at.get("entropy"),
                "sampled_entropy": at.get("sampled_entropy"), "rank": None if place is None else place + 1,
                "top": top, "forked": True,
            })  # fmt: skip
        ids = [s.get("token_id", -1) for s in carried]
        prefix = "".join(str(s.get("shown", "")) for s in carried)
        remote = (self.engine_facts or {}).get("backend") == "remote" or any(type(i) is not int or i < 0 for i in ids)
        label = self.label(cid, upto)
        if remote:
            messages = self.messages(upto, cid) + [{"role": "assistant", "content": prefix}]
            req = self.request(messages, arrival, cid, continue_final_message=True, add_generation_prompt=False,
                               label=label)  # fmt: skip
        else:
            req = self.request(self.messages(upto, cid), arrival, cid, reply_ids=tuple(ids), label=label)
        return req, prefix, carried

    @staticmethod
    def _forked_prefix(decoded: str, carried: list[dict], fork: Fork) -> str:
        """The fork's text as the engine decodes its tokens; the forked token shows what it adds to it."""
        if fork.token is not None and carried:
            before = "".join(str(s.get("shown", "")) for s in carried[:-1])
            if decoded.startswith(before):
                carried[-1]["shown"] = decoded[len(before) :]
        return decoded

    def _count_tokens(self, upto: list[Message], acc: Accounting) -> None:
        """Each message's token count, for the transcript (only those not counted yet)."""
        self.summary = acc.summary
        n_sys = 1 if self.settings_for(upto[0].conversation_id if upto else None).system_prompt else 0
        for m, n in zip(upto, acc.message_tokens[n_sys : n_sys + len(upto)]):
            if m.token_count is None:
                self.guard(self.store.update_message, m.id, token_count=n)

    @property
    def streaming_stats(self) -> ReplyStats | None:
        """The figures of the reply streaming now (whichever the panel shows)."""
        return None if self.streaming_mid is None else self.stats_by_message.get(self.streaming_mid)

    def heading(self) -> str:
        """Which reply the panel describes, in words: its state, its conversation, its place in the branch
        and among its versions, and the engine and model that made it."""
        st, mid = self.stats, self.selected_mid
        if mid is None or st.status == "idle":
            return st.title
        conv = self.store.conversation(self.store.message(mid).conversation_id)
        where = f"“{conv.title}”"
        if self.store.kept(conv.id):  # its branch is read (a long one being read is not read again here)
            path = self.store.branch(conv.id)
            at = next((k for k, b in enumerate(path) if b.id == mid), None)
            if at is None:
                where += ", on another branch"
            else:
                mark = branch_mark(self.store.versions(conv.id), path[: at + 1])
                where += f", message {at + 1} of {len(path)}" + (f", branch {mark}" if mark else "")
        return f"{st.title}\n{where}\nby {model_words(st.made_by)}"

    def save_partial(self) -> None:
        """On close mid-reply: what streamed so far is kept, marked stopped."""
        if self.generating and self.streaming_mid is not None:
            self.client.stop()
            self.guard(
                self.store.update_message,
                self.streaming_mid,
                content=self.stream_text,
                status="stopped",
                token_count=self.streaming_stats.tokens,
            )
