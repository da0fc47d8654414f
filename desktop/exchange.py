"""A conversation out of the app and back: as Markdown (the branch shown, for reading) and as JSON
(every message of every branch, each reply's trace; importable). No Qt here."""

from __future__ import annotations

import json

from .store import Conversation, Store

FORMAT, VERSION = "kvchat-conversation", 1
ROLES = ("system", "user", "assistant")
STATUSES = ("complete", "incomplete", "stopped", "failed", "length")
NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}


def to_markdown(store: Store, cid: int) -> str:
    """The branch on screen as a readable Markdown document."""
    conv = store.conversation(cid)
    parts = [f"# {conv.title}"]
    for m in store.branch(cid):
        note = "" if m.status == "complete" else f" ({m.status})"
        parts.append(f"**{NAMES.get(m.role, m.role)}**{note}\n\n{m.content}")
    return "\n\n".join(parts) + "\n"


def to_json(store: Store, cid: int) -> dict:
    """The whole tree: messages with their parents, the branch shown (its leaf), each reply's trace."""
    conv = store.conversation(cid)
    return {
        "format": FORMAT,
        "version": VERSION,
        "title": conv.title,
        "created": conv.created,
        "leaf_id": conv.leaf_id,
        "messages": [
            {
                "id": m.id,
                "parent_id": m.parent_id,
                "role": m.role,
                "content": m.content,
                "status": "incomplete" if m.status == "streaming" else m.status,
                "token_count": m.token_count,
                "created": m.created,
                "trace": m.trace,
            }
            for m in store.all_messages(cid)
        ],
    }


class ExchangeError(ValueError):
    """The file is not a conversation kvchat exported, or is damaged; the message says what is wrong."""


def from_json(store: Store, data) -> Conversation:
    """A new conversation with the same tree (new ids), the same branch shown. Checked before anything is
    written: a bad file adds nothing."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ExchangeError('not a kvchat conversation (its "format" is not kvchat-conversation)')
    if data.get("version") != VERSION:
        raise ExchangeError(f"version {data.get('version')!r} of the format is not known here (only {VERSION})")
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ExchangeError("it holds no messages")
    seen: set = set()
    for i, m in enumerate(msgs):
        ok = isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        if not ok or not isinstance(m.get("id"), int):
            raise ExchangeError(f"message {i} needs an integer id, a role among {', '.join(ROLES)} and text")
        if m.get("parent_id") is not None and m["parent_id"] not in seen:
            raise ExchangeError(f"message {i}'s parent {m['parent_id']!r} does not come before it")
        if m["id"] in seen:
            raise ExchangeError(f"message id {m['id']} appears twice")
        seen.add(m["id"])
    leaf = data.get("leaf_id")
    if leaf is not None and leaf not in seen:
        raise ExchangeError(f"the branch shown ends at message {leaf!r}, which it does not hold")
    title = data.get("title") if isinstance(data.get("title"), str) else "Imported"
    conv = store.new_conversation(title)
    new_ids: dict[int, int] = {}
    for m in msgs:
        status = m.get("status") if m.get("status") in STATUSES else "complete"
        tokens = m.get("token_count") if isinstance(m.get("token_count"), int) else None
        added = store.add_message(conv.id, new_ids.get(m.get("parent_id")), m["role"], m["content"], status, tokens)
        if isinstance(m.get("trace"), dict):
            store.update_message(added.id, trace=m["trace"])
        new_ids[m["id"]] = added.id
    store.set_leaf(conv.id, new_ids.get(leaf, added.id))
    return store.conversation(conv.id)


def read_json(path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExchangeError(f"{path} cannot be read as JSON: {e}") from None
