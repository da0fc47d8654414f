"""A reply's run, without Qt: one reply or a set of alternatives of one prompt started, the engine's events streamed
into its message, its figures and its lane's context map, and what it leaves in the store when it ends — the part
of the chat controller (chat.ChatController is one) between a Send and the reply's last event."""

from __future__ import annotations

import asyncio

from engine.events import Failed, Finished, PrefillDone, PrefillStarted, Token
from engine.images import ImageError
from engine.request import choice_requests
from engine.session import Request

from .replies import STATUS_BY_REASON, Accounting, ReplyStats, left_out, made_by
from .store import Message
from .streams import Stream

SAVE_EVERY_S = 0.25  # partial replies reach the database this often while streaming


class ReplyRuns:
    """The chat controller's reply runs: it holds the store, the client, the listener, the streams and the runs."""

    def _release(self, cid: int, n: int = 1) -> None:
        """Replies of conversation `cid` that ended (or will not start): at none left, it takes a Send again."""
        self.runs[cid] = self.runs.get(cid, 0) - n
        if self.runs[cid] <= 0:
            del self.runs[cid]

    async def _alternatives(self, cid: int, upto: list[Message], parent_id: int, arrival: float, n: int) -> None:
        """`n` replies to one prompt in one batch: the first's prefill goes to the prefix store
        (Request.share_prompt), and the others start once it is done, copying that prompt from there; each samples
        with its own seed (choice_requests). The branch shown is the first's."""
        await self.list_tools(cid)
        base = self.request(self.messages(upto, cid), arrival, cid, label=self.label(cid, upto))
        requests = choice_requests(base, n)
        prefilled = asyncio.Event()
        first = asyncio.ensure_future(
            self._reply(cid, upto, parent_id, arrival, None, None, requests[0], (1, n), prefilled)
        )
        waiting = asyncio.ensure_future(prefilled.wait())
        await asyncio.wait({first, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        others = []
        if prefilled.is_set():
            others = [self._reply(cid, upto, parent_id, arrival, None, None, r, (i + 1, n)) for i, r in
                      enumerate(requests[1:], 1)]  # fmt: skip
        else:  # the first ended before its prefill did (it failed, or was stopped): the others are not run
            self._release(cid, n - 1)
        try:
            await asyncio.gather(first, *others)
        finally:
            self._lead.pop(cid, None)

    async def _reply(self, cid: int, upto: list[Message], parent_id: int, arrival: float, continue_mid, fork=None,
                     req: Request | None = None, alternative=None, prefilled: asyncio.Event | None = None):  # fmt: skip
        stream = None
        try:
            if req is None:
                await self.list_tools(cid)
            stream = await self._start_reply(cid, upto, parent_id, arrival, continue_mid, fork, req, alternative,
                                             prefilled)  # fmt: skip
        except ImageError as e:  # a message's image gone from the folder or changed: said, nothing started
            self.listener.show_error(f"The reply could not start: {e}")
        finally:
            self._ended(cid, stream)
        rounds = 1
        while stream is not None and stream.calls:  # the reply called tools: run them, then the next reply
            stream = await self.tool_round(cid, stream.mid, stream.calls, rounds)
            rounds += 1

    def _ended(self, cid: int, stream: Stream | None) -> None:
        """A reply's run ended: its stream gone, and its claim given back where it did not end as replies do."""
        if stream is not None:
            self.streams.pop(stream.mid, None)
        if stream is None or not stream.released:  # it ended some other way (cancelled, a bug): claim back
            self._release(cid)

    async def _start_reply(self, cid, upto, parent_id, arrival, continue_mid, fork, req, alternative, prefilled):
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
            req = req or self.request(self.messages(upto, cid), arrival, cid, label=self.label(cid, upto))
        assistant = self.store.add_message(cid, parent_id, "assistant", prefix, status="streaming")
        stats = self.stats_by_message[assistant.id] = ReplyStats(
            arrival=arrival, status="prefill", made_by=made_by(self.engine_facts), steps=carried, carried=old_tokens
        )  # its own: the panel may show another reply meanwhile (another conversation opened)
        title = self.store.conversation(cid).title
        stream = self.streams[assistant.id] = Stream(cid, assistant.id, req, stats, title, prefix,
                                                     alternative=alternative)  # fmt: skip
        if alternative is None or alternative[0] == 1:  # the panel follows it (the first of alternatives)
            self.stats, self.selected_mid = stats, assistant.id
        caption = f"the reply to “{title}”, message {len(upto) + 1}"
        if alternative is not None:
            caption += f", alternative {alternative[0]} of {alternative[1]}"
        if alternative is not None and alternative[0] == 1:
            self._lead[cid] = assistant.id
        elif alternative is not None and self._lead.get(cid) is not None:  # the first alternative stays on screen
            self.guard(self.store.set_leaf, cid, self._lead[cid])
        self.listener.transcript_changed()
        await self._stream(stream, upto, prefix, old_tokens, carried, fork, caption, prefilled)
        return stream

    async def _stream(self, stream: Stream, upto, prefix: str, old_tokens: int, carried, fork, caption, prefilled):
        """The reply's events into its message, its figures and its lane's context map, then its record."""
        req, stats, cid, assistant = stream.request, stream.stats, stream.cid, self.store.message(stream.mid)
        highlight, self._edit = self._edit, None
        text, saved, last_save, final = prefix, prefix, self.clock(), None
        async for batch in self.client.stream(req):
            first = False
            for ev in batch:
                if isinstance(ev, Accounting):
                    self._count_tokens(upto, ev)
                    continue
                if isinstance(ev, PrefillStarted):
                    if ev.reply_prefix and fork is not None and text == prefix:
                        text = self._forked_prefix(ev.reply_prefix, carried, fork)  # the engine's own decode of it
                        prefix = saved = text
                    stream.lane, stream.prefill_at = ev.lane or 0, self.clock()
                    cache_map = self.lane_maps.of(ev.lane)
                    cache_map.start(req.messages or [], len(req.reply_ids), caption)
                    if self.selected_mid == stream.mid or stream.mid == next(reversed(self.streams)):
                        self.lane_maps.shown = cache_map
                text += stats.apply(ev)
                if stream.lane is not None:
                    self.lane_maps.of(stream.lane).apply(ev)
                if isinstance(ev, PrefillDone) and prefilled is not None:
                    prefilled.set()  # its prompt is in the prefix store: the other alternatives start
                first = first or (isinstance(ev, Token) and ev.index == 1)
                if isinstance(ev, (Finished, Failed)):
                    final = ev
                    self.store_state = (ev.cache or {}).get("store", self.store_state)
            stream.text = text
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
        self.take_calls(record, stream, getattr(final, "tool_calls", ()))
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
        stream.text, stream.released = text, True
        self.streams.pop(stream.mid, None)
        self._release(cid)
        self.listener.transcript_changed()
        mark = None
        reuse = stats.reuse or {}
        if highlight and reuse.get("first_invalidated_position") is not None:
            width = len((reuse.get("new_token") or {}).get("text", "").strip()) or 1
            mark = (highlight[0], highlight[1], highlight[1] + width)  # (message, first, end character)
        self.listener.reply_finished(final, mark)

    def _count_tokens(self, upto: list[Message], acc: Accounting) -> None:
        """Each message's token count, for the transcript (only those not counted yet)."""
        self.summary = acc.summary
        n_sys = 1 if self.settings_for(upto[0].conversation_id if upto else None).system_prompt else 0
        for m, n in zip(upto, acc.message_tokens[n_sys : n_sys + len(upto)]):
            if m.token_count is None:
                self.guard(self.store.update_message, m.id, token_count=n)
