"""A conversation out of the app and back: as Markdown (the branch shown, for reading) and as JSON
(every message of every branch, each reply's trace; importable). No Qt here."""

from __future__ import annotations

import base64
import json
import math
import sqlite3

from engine.errors import EngineError
from engine.grammar import KINDS as GRAMMAR_KINDS
from engine.images import ImageError, data_url_image

from .image_files import DIGEST
from .records import clean_record
from .replies import reply_footer
from .settings import CONVERSATION_FIELDS, Settings
from .store import Conversation, Store

FORMAT, VERSION = "kvchat-conversation", 1
ROLES = ("system", "user", "assistant", "tool")
STATUSES = ("complete", "incomplete", "stopped", "failed", "length")
NAMES = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool result"}
PROGRESS_EVERY = 500  # messages an import writes between two reports of its progress


def _quoted(text: str) -> str:
    """A message's text as a Markdown block quote: its own Markdown still reads as Markdown, and no line of
    it can pass for the export's own turn headings (a reply that writes `**You**` stays inside its quote)."""
    return "\n".join(">" + (" " + line if line else "") for line in text.split("\n"))


TITLE_CHARS = 200  # a Markdown export's heading: the first message's first line up to this, when the title was cut


def heading(conv: Conversation, branch: list) -> str:
    """A conversation's title for a document: the title as given, or, where the app cut it from the first
    message ("… a trip to Chengdu for 3 nights. My…"), that message's first line whole."""
    title = " ".join(conv.title.split())
    first = next((m.content for m in branch if m.role == "user"), "")
    line = " ".join(first.strip().split("\n", 1)[0].split())
    if title.endswith("…") and line.startswith(title[:-1].rstrip()):
        return line[:TITLE_CHARS] + ("…" if len(line) > TITLE_CHARS else "")
    return title


def to_markdown(store: Store, cid: int, link=None) -> str:
    """The branch on screen as a readable Markdown document: a heading per turn, its text quoted; where
    other branches exist, a line says so (the JSON export holds them all). `link(ref)`: where a message's image
    is written beside the document (a relative path), None: images named only."""
    conv = store.conversation(cid)
    branch = store.branch(cid)
    parts = [f"# {heading(conv, branch)}"]
    versions = store.versions(cid)
    edited = sum(1 for m in branch if versions.get(m.id, (0, 1))[1] > 1)
    if edited:
        some = "1 of its messages has" if edited == 1 else f"{edited} of its messages have"
        parts.append(f"*The branch shown: {some} other versions, on other branches (the JSON export holds them all).*")
    for m in branch:
        note = "" if m.status == "complete" else f" ({m.status})"
        parts.append(f"**{NAMES.get(m.role, m.role)}**{note}{_tool_note(m)}\n\n{_quoted(m.content)}")
        for ref in (m.trace or {}).get("images") or () if m.role == "user" else ():
            alt = ref["name"].replace("[", "(").replace("]", ")")
            where = link(ref) if link is not None else None
            parts.append(f"![{alt}]({where})" if where else f"*An image: {alt} ({ref['width']}×{ref['height']})*")
        for c in (m.trace or {}).get("tool_calls") or () if m.role == "assistant" else ():
            parts.append(_quoted(f"Calls {c['name']} with {c['arguments']}"))
        figures = reply_footer(m.trace) if m.role == "assistant" else ""
        if figures:  # a reply's figures on one line of their own, after its quote
            parts.append("Figures: " + " ".join(figures.split()))
    return "\n\n".join(parts) + "\n"


def _tool_note(m) -> str:
    """Which call a tool's result answers, for its heading."""
    record = m.trace if m.role == "tool" and isinstance(m.trace, dict) else {}
    call = record.get("tool_call") or {}
    return f" of `{call['name']}` ({record.get('server') or 'no server'})" if call.get("name") else ""


def to_json(store: Store, cid: int) -> dict:
    """The whole tree: messages with their parents, the branch shown (its leaf), each reply's trace."""
    conv = store.conversation(cid)
    return {
        "format": FORMAT,
        "version": VERSION,
        "title": conv.title,
        "settings": conversation_settings(conv.settings),
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
        "images": embedded_images(store, store.all_messages(cid)),
    }


def embedded_images(store: Store, messages) -> dict:
    """The messages' images for a JSON export, by hash: each one's bytes (base64), format and name; one whose file
    is gone from kvchat's folder is left out (its message keeps the reference, an import then drops it)."""
    out = {}
    for m in messages:
        for ref in (m.trace or {}).get("images") or () if m.role == "user" else ():
            if ref["digest"] in out:
                continue
            try:
                image = store.images.image(ref)
            except ImageError:
                continue
            out[ref["digest"]] = {"name": ref["name"], "format": image.format,
                                  "data": base64.b64encode(image.data).decode()}  # fmt: skip
    return out


MAX_IMPORTED_IMAGES = 1000


def keep_imported_images(store: Store, images) -> set[str]:
    """An import's images checked (each decoded under the engine's limits, its hash its key) and kept in kvchat's
    folder before anything else is written; the hashes kept. A bad one refuses the file."""
    if images is None:
        return set()
    if not isinstance(images, dict) or len(images) > MAX_IMPORTED_IMAGES:
        raise ExchangeError(f'its "images" must be an object of at most {MAX_IMPORTED_IMAGES} images')
    kept = set()
    for digest, item in images.items():
        ok = isinstance(item, dict) and isinstance(item.get("data"), str) and isinstance(item.get("name"), str)
        if not ok or not DIGEST.fullmatch(str(digest)):
            raise ExchangeError(f"image {str(digest)[:16]!r} is not one kvchat exports (a hash, a name and data)")
        try:
            image = data_url_image(f"data:image/png;base64,{item['data']}", item["name"][:200])
        except ImageError as e:
            raise ExchangeError(f"image {item['name'][:80]!r}: {e}") from None
        if image.digest != digest:
            raise ExchangeError(f"image {item['name'][:80]!r} is not the image its hash names")
        store.images.keep(image)
        kept.add(digest)
    return kept


def conversation_settings(own) -> dict | None:
    """A conversation's own settings as an export carries them and an import takes them: the system prompt,
    the sampling, max new tokens and the overflow policy, each of its type (anything else is dropped)."""
    if not isinstance(own, dict):
        return None
    kinds = {k: type(getattr(Settings(), k)) for k in CONVERSATION_FIELDS}
    kept = {k: kinds[k](v) for k, v in own.items() if k in kinds and _of_kind(v, kinds[k]) and k != "tools"}
    # (the tools a conversation offers are not taken from a file: the person turns them on, here)
    fmt = kept.get("reply_format", "")
    try:  # a reply format is kept only whole: a kind kvchat has, with a schema or grammar that is one (sizes checked)
        if fmt and fmt not in GRAMMAR_KINDS:
            raise EngineError(f"no reply format {fmt!r}")
        Settings(reply_format=fmt, reply_grammar=kept.get("reply_grammar", "")).grammar()
    except EngineError:
        kept.pop("reply_format", None)
        kept.pop("reply_grammar", None)
    return kept or None


def _of_kind(v, kind) -> bool:
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if kind is int:
        return _integer(v)
    return isinstance(v, kind) and (kind is not str or _text(v))


class ExchangeError(ValueError):
    """The file is not a conversation kvchat exported, or is damaged; the message says what is wrong."""


def from_json(store: Store, data, progress=None) -> Conversation:
    """A new conversation with the same tree (new ids), the same branch shown. Checked before anything is
    written, and written in one transaction: a bad file, or one that fails halfway, adds nothing.
    `progress(done, total)` is told every PROGRESS_EVERY messages."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ExchangeError('not a kvchat conversation (its "format" is not kvchat-conversation)')
    if data.get("version") != VERSION:
        raise ExchangeError(f"version {data.get('version')!r} of the format is not known here (only {VERSION})")
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ExchangeError("it holds no messages")
    seen: set = set()
    for i, m in enumerate(msgs):
        ok = isinstance(m, dict) and m.get("role") in ROLES and _text(m.get("content"))
        if not ok or not _integer(m.get("id")):
            raise ExchangeError(f"message {i} needs an integer id, a role among {', '.join(ROLES)} and text")
        if m.get("parent_id") is not None and (not _integer(m["parent_id"]) or m["parent_id"] not in seen):
            raise ExchangeError(f"message {i}'s parent {m['parent_id']!r} does not come before it")
        if m["id"] in seen:
            raise ExchangeError(f"message id {m['id']} appears twice")
        seen.add(m["id"])
    leaf = data.get("leaf_id")
    if leaf is not None and (not _integer(leaf) or leaf not in seen):
        raise ExchangeError(f"the branch shown ends at message {leaf!r}, which it does not hold")
    try:
        keep_imported_images(store, data.get("images"))
    except OSError as e:
        raise ExchangeError(f"its images could not be kept in kvchat's folder: {e.strerror or e}") from None
    title = data.get("title") if _text(data.get("title")) else "Imported"
    if any(c.title == title for c in store.conversations()):  # told apart from the original in the list
        title += " (imported)"
    try:
        conv = _write_tree(store, title, conversation_settings(data.get("settings")), msgs, leaf, progress)
    except (ValueError, OverflowError, TypeError, sqlite3.Error) as e:  # rolled back: nothing was added
        raise ExchangeError(f"it could not be written ({type(e).__name__}: {e}); nothing was added") from None
    return store.conversation(conv.id)


def _write_tree(store: Store, title: str, settings: dict | None, msgs: list, leaf, progress) -> Conversation:
    with store.transaction():  # all of it, or none: a file that fails halfway (or a kill) adds nothing
        conv = store.new_conversation(title, settings)
        new_ids: dict[int, int] = {}
        for i, m in enumerate(msgs):
            if progress is not None and i % PROGRESS_EVERY == 0:
                progress(i, len(msgs))
            status = m.get("status") if m.get("status") in STATUSES else "complete"
            tokens = m.get("token_count") if _integer(m.get("token_count")) and m["token_count"] >= 0 else None
            parent = new_ids.get(m.get("parent_id"))
            added = store.add_message(conv.id, parent, m["role"], m["content"], status, tokens)
            if isinstance(m.get("trace"), dict):  # checked and cut to size before it is kept (core/records.py)
                record = clean_record(m["trace"])
                if record.get("images"):  # only images the folder now holds (the file's, or kept before)
                    record["images"] = [r for r in record["images"] if store.images.path(r).is_file()] or None
                store.update_message(added.id, trace=record)
            new_ids[m["id"]] = added.id
        store.set_leaf(conv.id, new_ids.get(leaf, added.id))
    return conv


def _integer(v) -> bool:
    """An id or count SQLite can hold (a JSON integer of 2^70 cannot)."""
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _text(v) -> bool:
    """Text SQLite can hold: a string that is valid Unicode (a lone surrogate, `\\ud800`, is not)."""
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_json(path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExchangeError(f"{path} cannot be read as JSON: {e}") from None
    except RecursionError:
        raise ExchangeError(f"{path} is nested too deeply to be a conversation") from None
