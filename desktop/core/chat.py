"""The chat logic without Qt: send, edit, regenerate, continue and branch switching over the
conversation store, the request each builds, and what each engine event does to the reply.

The window drives a ChatController and shows what it holds; tests drive it with a fake client.
The controller talks back through a listener (the window) with four calls: the transcript
changed, the reply progressed, the reply finished, an error to show. Replies in different
conversations stream at once (the engine runs them side by side, engine.batching); one
conversation runs one reply at a time, or one set of alternatives of one prompt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.session import Request

from .cache_map import CacheMap
from .prompts import Prompts
from .replies import (
    CONTINUABLE,
    Fork,
    ReplyStats,
    branch_mark,
    first_difference,
    model_words,
    title_from,
)
from .reply_runs import ReplyRuns
from .settings import Settings
from .store import Message, Store
from .store_file import StoreError
from .streams import LaneMaps, Stream
from .tool_turns import ToolTurns


class Client(Protocol):
    """Where replies come from: the worker thread (desktop.client) or, in tests, a fake."""

    def stream(self, request: Request) -> AsyncIterator[tuple]: ...

    def stop(self, request: Request | None = None) -> None: ...


class Listener(Protocol):
    def transcript_changed(self) -> None: ...

    def reply_progressed(self) -> None: ...

    def first_token(self) -> None: ...

    def reply_finished(self, final, highlight: tuple[int, int, int] | None) -> None: ...

    def show_error(self, text: str) -> None: ...


class ChatController(Prompts, ToolTurns, ReplyRuns):
    """One conversation shown at a time over the store; replies streaming in any of them."""

    def __init__(self, store: Store, client: Client, settings: Settings, listener: Listener, clock):
        self.store, self.client, self.settings, self.listener, self.clock = store, client, settings, listener, clock
        self.current_cid: int | None = None
        self.runs: dict[int, int] = {}  # conversation id → its replies claimed and not ended (start() claims at once)
        self.streams: dict[int, Stream] = {}  # message id → the reply streaming into it, in the order they started
        self.stats = ReplyStats()  # the reply the panel shows
        self.engine_facts: dict | None = None  # the engine and model in use (the window's, once loaded)
        self.stats_by_message: dict[int, ReplyStats] = {}
        self.selected_mid: int | None = None
        self.summary: dict | None = None  # the session's figures after the last reply
        self.store_state: dict | None = None  # the prefix store after the last reply or probe
        self._edit: tuple[int, int] | None = None  # (new message id, first changed character) of an edit
        self._lead: dict[int, int] = {}  # conversation id → the first alternative's message, while they start
        self.lane_maps = LaneMaps()  # each engine lane's cache now: what each position holds, where it came from
        self._tools_init()

    # --- what streams ----------------------------------------------------------------------------
    @property
    def generating(self) -> bool:
        """Whether the conversation shown has a reply streaming (another conversation's does not stop this one's
        Send)."""
        return self.current_cid is not None and self.current_cid in self.runs

    @property
    def busy(self) -> bool:
        """Whether any reply streams, in any conversation."""
        return bool(self.runs)

    def streams_in(self, cid: int | None) -> list[Stream]:
        return [st for st in self.streams.values() if st.cid == cid]

    @property
    def streaming_mid(self) -> int | None:
        """The newest reply streaming in the conversation shown."""
        here = self.streams_in(self.current_cid)
        return here[-1].mid if here else None

    @property
    def stream_text(self) -> str:
        mid = self.streaming_mid
        return "" if mid is None else self.streams[mid].text

    @property
    def cache_map(self) -> CacheMap:
        """The context map the panel shows: the lane of the reply it describes while that streams, else the
        lane the last reply filled."""
        st = self.streams.get(self.selected_mid)
        if st is not None and st.lane is not None:
            return self.lane_maps.of(st.lane)
        return self.lane_maps.shown

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
        """A new conversation shown (a reply streaming in the one left goes on there)."""
        conv = self.guard(self.store.new_conversation, "New chat", self.settings.conversation_part())
        if conv is None:
            return False
        self.current_cid = conv.id
        return True

    def switch_branch(self, mid: int, delta: int) -> bool:
        """Show the sibling `delta` away from message `mid` (‹ ›), down to that branch's newest leaf; also while
        replies stream (alternatives: each into its own branch, drawn when shown)."""
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
        if mid is not None and mid in self.streams:  # streaming: its live figures (another's may be shown)
            if self.selected_mid == mid and self.stats is self.streams[mid].stats:
                return False
            self.selected_mid, self.stats = mid, self.streams[mid].stats
            return True
        if mid is not None and mid == self.selected_mid and self.stats is self.stats_by_message.get(mid):
            return False
        if mid is not None and self.select_message(mid, wait=False) is not None:
            return True
        changed = self.stats.status != "idle" or self.selected_mid != mid
        self.selected_mid, self.stats = mid, ReplyStats()  # a reply with no figures (an import), or no reply
        return changed

    # --- what a person does --------------------------------------------------------------------
    def send(self, text: str, arrival: float, images=()) -> int | None:
        """A new user message on the current branch (a new conversation if none), with `images` (engine.images.Image,
        kept in the store's image folder first: nothing is stored half); returns its id, whose reply the caller then
        runs (`reply`)."""
        text = text.strip()
        if not (text or images) or self.generating:
            return None
        try:
            refs = [self.store.images.keep(im) for im in images]
        except OSError as e:
            self.listener.show_error(f"The images could not be kept in kvchat's folder: {e.strerror or e}")
            return None
        if self.current_cid is None:
            named = text or images[0].name or "An image"
            conv = self.guard(self.store.new_conversation, title_from(named), self.settings.conversation_part())
            if conv is None:
                return None
            self.current_cid = conv.id
        else:
            conv = self.store.conversation(self.current_cid)
            if conv.title == "New chat":
                self.guard(self.store.rename, conv.id, title_from(text or images[0].name or "An image"))
        user = self.guard(self.store.add_message, self.current_cid, conv.leaf_id, "user", text)
        if user is not None and refs:
            self.guard(self.store.update_message, user.id, trace={"images": refs})
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
        images = (old.trace or {}).get("images") if old.role == "user" else None
        if images:  # an edit of the text keeps the message's images
            self.guard(self.store.update_message, new.id, trace={"images": images})
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
        """Stop the replies streaming in the conversation shown (those in others go on)."""
        for st in self.streams_in(self.current_cid):
            self.client.stop(st.request)
        self.stop_tools(self.current_cid)

    def start(self, parent_id: int, arrival: float, continue_mid: int | None = None, fork: Fork | None = None,
              alternatives: int = 1):  # fmt: skip
        """Claim the conversation's reply slot at once and return the coroutine that streams the reply to message
        `parent_id` (or extends reply `continue_mid`; or `alternatives` replies to it, side by side); None when
        one is already running in this conversation, so that two clicks in one event-loop turn start one. The
        reply stays in this conversation whatever the person opens while it streams."""
        if self.generating:
            return None
        cid = self.current_cid
        self.tools_halted.discard(cid)
        self.runs[cid] = self.runs.get(cid, 0) + max(1, alternatives)  # each reply gives its claim back as it ends
        upto = self.messages_until(parent_id)
        if alternatives > 1:
            return self._alternatives(cid, upto, parent_id, arrival, alternatives)
        return self._reply(cid, upto, parent_id, arrival, continue_mid, fork)

    async def reply(self, parent_id: int, arrival: float, continue_mid: int | None = None) -> None:
        """start() and wait for the reply to end."""
        run = self.start(parent_id, arrival, continue_mid)
        if run is not None:
            await run

    @property
    def streaming_stats(self) -> ReplyStats | None:
        """The figures of the newest reply streaming in the conversation shown (whichever the panel shows)."""
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
        """On close mid-reply: what every reply streamed so far is kept, marked stopped."""
        if self.streams:
            self.client.stop()
        for st in list(self.streams.values()):
            self.guard(self.store.update_message, st.mid, content=st.text, status="stopped",
                       token_count=st.stats.tokens)  # fmt: skip
