"""What the model is asked, without Qt: the settings a conversation runs under, the messages it sends, the
Request each action builds (a fork's keeps the tokens before it), and the name its prompt has in the prefix store."""

from __future__ import annotations

from engine.logprobs import MAX_TOP_LOGPROBS
from engine.session import Request
from engine.tool_calls import template_call

from .replies import Fork, branch_mark
from .settings import Settings
from .store import Message


def chat_message(m: Message, image=None) -> dict:
    """A stored message as the chat template reads it: a reply's tool calls (their arguments as objects), a tool's
    result with the call it answers, a user's images (`image(ref)`: the image a record's reference names)."""
    record = m.trace if isinstance(m.trace, dict) else {}
    refs = record.get("images") if m.role == "user" else None
    if refs and image is not None:
        return {"role": "user", "content": m.content, "images": tuple(image(r) for r in refs)}
    if m.role == "tool":
        call = record.get("tool_call") or {}
        return {"role": "tool", "content": m.content, "tool_call_id": call.get("id", ""), "name": call.get("name", "")}
    calls = record.get("tool_calls") if m.role == "assistant" else None
    if calls:
        made = [template_call(c["id"], c["name"], c["arguments"]) for c in calls]
        return {"role": "assistant", "content": m.content, "tool_calls": made}
    return {"role": m.role, "content": m.content}


class Prompts:
    """The chat controller's requests (chat.ChatController is one): over its store, settings and conversation shown."""

    def settings_for(self, cid: int | None = None) -> Settings:
        """The app's settings with the conversation's own system prompt and sampling over them."""
        cid = self.current_cid if cid is None else cid
        own = self.store.conversation(cid).settings if cid is not None else None
        return self.settings.with_conversation(own)

    def messages(self, upto: list[Message], cid: int | None = None) -> list[dict]:
        """What the model sees: the conversation's system prompt, then the messages of the branch up to here."""
        prompt = self.settings_for(cid).system_prompt
        system = [{"role": "system", "content": prompt}] if prompt else []
        return system + [chat_message(m, self.store.images.image) for m in upto]

    def request(self, messages: list[dict], arrival: float, cid: int | None = None, **kw) -> Request:
        s = self.settings_for(cid)
        kw = {**self.tool_fields(cid, messages), **kw}
        top = max(0, min(MAX_TOP_LOGPROBS, s.token_alternatives))
        drafts = {"speculative": s.speculative or None, "draft_tokens": s.draft_tokens} if s.speculative else {}
        return Request(messages=messages, sampling=s.sampling(), max_new_tokens=s.max_new_tokens, arrival=arrival,
                       logprobs=True, top_logprobs=top, overflow=s.policy, grammar=s.grammar_or_none(), **drafts,
                       **kw)  # fmt: skip

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
