"""Conversations as message trees, persisted in SQLite (WAL). No Qt here: the views adapt it.

Each message has a parent; an edit or a regeneration adds a sibling, so the old branch stays.
A conversation remembers its current leaf; the path from the root to it is what the transcript
shows and what the model sees. Partial replies are written as they stream (status "streaming"),
so a crash loses nothing that was shown; on the next start they read as "incomplete".
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import MappingProxyType

from .image_files import ImageFiles
from .records import CheckedRecords
from .store_file import StoreFile

HEAD_COLUMNS = "id, conversation_id, parent_id, role, content, status, token_count, created"
RECORDS_AT_ONCE = 1_000_000  # characters of records tail() reads on the GUI thread (more: read_later reads them)


def _conversation(r) -> Conversation:
    try:
        raw = r["settings"] if "settings" in r.keys() else None  # a read-only database of an older kvchat
        settings = json.loads(raw) if raw else None
    except ValueError:  # damaged: the app's settings apply
        settings = None
    return Conversation(r["id"], r["title"], r["created"], r["updated"], r["leaf_id"], settings)


def _version_groups(rows) -> dict[tuple, list[int]]:
    """(id, parent_id, role) rows, oldest first -> (parent_id, role) -> the ids of those versions."""
    groups: dict[tuple, list[int]] = {}
    for mid, parent, role in rows:
        groups.setdefault((parent, role), []).append(mid)
    return groups


@dataclasses.dataclass(frozen=True)
class Message:
    """A stored message as read (frozen: the store keeps the branches it read and hands out the same
    objects; a change is a new one, `dataclasses.replace`)."""

    id: int
    conversation_id: int
    parent_id: int | None
    role: str
    content: str
    status: str = "complete"  # complete | streaming | incomplete | stopped | failed | length
    token_count: int | None = None
    created: float = 0.0
    trace: dict | None = None


@dataclasses.dataclass
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    leaf_id: int | None
    settings: dict | None = None  # its own system prompt and sampling (None: the app's)


@dataclasses.dataclass
class SearchHit:
    """Where a search matched a conversation's messages: the first such message, and its words around
    the match (shown under the conversation's title)."""

    message_id: int
    snippet: str


SNIPPET_WORDS = 8  # words of a message shown for a search's match
SNIPPET_BEFORE = 2  # of which before the match (the list is narrow: the match comes early)
MARK = "\x02"  # where FTS5's highlight() says the match begins


def _like(search: str) -> str:
    """A LIKE pattern that matches the search as typed: its % and _ are characters, not wildcards."""
    return "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _searched(search: str) -> str:
    """What is searched for: the text typed, trimmed, without NULs (no message can hold one)."""
    return search.replace("\x00", "").strip()


def _fts_terms(search: str) -> str:
    """The search's words as an FTS5 query: each a quoted prefix, all of them required."""
    return " ".join('"' + w.replace('"', '""') + '"*' for w in search.split())


def _snippet(text: str, at: int) -> str:
    """The message's words around character `at` (where the match begins), on one line."""
    while at > 0 and not text[at - 1].isspace():  # from the start of the word the match is in
        at -= 1
    before, after = text[:at].split(), text[at:].split()
    lead = before[-SNIPPET_BEFORE:] if before else []
    rest = SNIPPET_WORDS - len(lead)
    return ("…" if len(before) > len(lead) else "") + " ".join(lead + after[:rest]) + ("…" if len(after) > rest else "")


BRANCHES_KEPT = 8  # conversations whose branch and versions the store keeps between reads
MAX_DEPTH = 1_000_000  # messages in one branch, at most (a guard against a parent chain that loops)
REBASE_STEP = 64  # messages read at a time walking up from a new leaf to a kept branch
REBASE_MAX = 4096  # further than this, a kept branch is read again whole
# The path from message ? up to the root, at most ? steps (path.depth 0 is the message itself).
WALK_UP = (
    "WITH RECURSIVE path(id, depth) AS (SELECT ?, 0 "
    "UNION ALL SELECT m.parent_id, p.depth + 1 FROM messages m JOIN path p ON m.id = p.id "
    "WHERE m.parent_id IS NOT NULL AND p.depth < ?) "
    "SELECT messages.* FROM path JOIN messages ON messages.id = path.id "
)


@dataclasses.dataclass
class _Kept:
    """A conversation's branch as read, and every message's versions, kept up to date by this store's own
    writes (add_message and update_message, the only ones to messages): a long conversation is read once,
    not at each switch, send or streamed save."""

    leaf: int
    path: list[Message]  # root -> leaf
    at: dict[int, int]  # message id -> its index in path
    groups: dict[tuple, list[int]]  # (parent_id, role) -> the ids of those versions, oldest first
    versions: dict[int, tuple[int, int]]  # message id -> (its index among its versions, how many)


class Store(StoreFile):
    """The conversations as message trees in the database file (store_file.StoreFile opens it safely): each
    conversation's branch is read once and then kept in step with this store's own writes."""

    def __init__(self, path: Path | str, connect_only: bool = False):
        self._branches: dict[int, _Kept] = {}  # conversation id -> its branch as read, kept up to date
        self._message_writes = 0  # add_message and update_message calls (a branch read before one is stale)
        self._records = CheckedRecords()  # the records read last, checked once
        super().__init__(path, connect_only)
        beside = self.path.name != ":memory:" and not self.temporary and not self.read_only
        # the messages' images: beside the database, or (a database in memory) in a folder of this run's
        self.images = ImageFiles(self.path.parent / "images" if beside else Path(tempfile.mkdtemp(prefix="kvchat-")))

    def for_thread(self) -> Store | None:
        """This database on a connection of its own, for another thread to write (an import); None where
        there is no file to reach that way (a temporary or read-only database)."""
        if self.read_only or self.path.name == ":memory:" or not self.path.exists() or self.temporary:
            return None
        return Store(self.path, connect_only=True)

    def forget_branches(self) -> None:
        self._branches.clear()

    # --- conversations ------------------------------------------------------------------
    def conversations(self, search: str = "") -> list[Conversation]:
        """Newest first; with `search`, those whose title or any message (any branch) holds its words
        (full-text, each word a prefix)."""
        search = _searched(search)
        if not search:
            sql, args = "SELECT * FROM conversations", ()
        elif self.fts:
            terms = _fts_terms(search)
            sql = (
                "SELECT * FROM conversations WHERE (title LIKE ? ESCAPE '\\' OR id IN (SELECT conversation_id "
                "FROM messages WHERE id IN (SELECT rowid FROM messages_fts WHERE messages_fts MATCH ?)))"
            )
            args = (_like(search), terms)
        else:
            sql = (
                "SELECT * FROM conversations WHERE (title LIKE ? ESCAPE '\\' OR id IN (SELECT conversation_id "
                "FROM messages WHERE content LIKE ? ESCAPE '\\'))"
            )
            args = (_like(search), _like(search))
        rows = [self._held_over(r, "conversations") for r in self.db.execute(sql, args).fetchall()]
        rows = sorted((r for r in rows if not r["deleted"]), key=lambda r: r["updated"], reverse=True)
        return [_conversation(r) for r in rows]

    def search_hits(self, search: str) -> dict[int, SearchHit]:
        """For each conversation with a message (any branch) that holds the search's words: the first
        such message and its words around the match."""
        search = _searched(search)
        if not search:
            return {}
        if self.fts:  # highlight() marks where the index matched (its tokenizer, not a substring)
            rows = self.db.execute(
                "SELECT m.conversation_id AS cid, m.id AS mid, highlight(messages_fts, 0, ?, '') AS marked "
                "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid WHERE messages_fts MATCH ? "
                "ORDER BY m.id",
                (MARK, _fts_terms(search)),
            ).fetchall()
            found = [(r["cid"], r["mid"], r["marked"].replace(MARK, ""), max(0, r["marked"].find(MARK))) for r in rows]
        else:
            rows = self.db.execute(
                "SELECT conversation_id AS cid, id AS mid, content FROM messages WHERE content LIKE ? ESCAPE '\\' "
                "ORDER BY id",
                (_like(search),),
            ).fetchall()
            found = [
                (r["cid"], r["mid"], r["content"], max(0, r["content"].lower().find(search.lower()))) for r in rows
            ]
        hits: dict[int, SearchHit] = {}
        for cid, mid, text, at in found:
            if cid not in hits:
                hits[cid] = SearchHit(mid, _snippet(text, at))
        return hits

    def conversation(self, cid: int) -> Conversation:
        row = self.db.execute("SELECT * FROM conversations WHERE id=?", (cid,)).fetchone()
        return _conversation(self._held_over(row, "conversations"))

    def new_conversation(self, title: str = "New chat", settings: dict | None = None) -> Conversation:
        now = time.time()
        cur = self._write(
            "INSERT INTO conversations(title, created, updated, settings) VALUES (?,?,?,?)",
            (title, now, now, json.dumps(settings) if settings is not None else None),
        )
        return self.conversation(cur.lastrowid)

    def set_settings(self, cid: int, settings: dict) -> None:
        """The conversation's own system prompt and sampling."""
        self._update("conversations", cid, settings=json.dumps(settings))

    def rename(self, cid: int, title: str) -> None:
        self._update("conversations", cid, title=title, updated=time.time())

    def delete(self, cid: int) -> None:
        """Soft delete, so it can be undone."""
        self._update("conversations", cid, deleted=1)

    def undelete(self, cid: int) -> None:
        self._update("conversations", cid, deleted=0)

    def set_leaf(self, cid: int, leaf_id: int | None) -> None:
        self._update("conversations", cid, leaf_id=leaf_id, updated=time.time())

    # --- messages -----------------------------------------------------------------------
    def _held_over(self, row, table: str):
        """A row as it reads with the changes a lock held back (as if written)."""
        held = self.held.get((table, row["id"])) if self.held and row is not None else None
        return {k: held.get(k, row[k]) for k in row.keys()} if held else row

    def _message(self, r, record: bool = True) -> Message:
        r = self._held_over(r, "messages")
        return Message(
            r["id"],
            r["conversation_id"],
            r["parent_id"],
            r["role"],
            r["content"],
            r["status"],
            r["token_count"],
            r["created"],
            self._records.read(r["id"], r["trace"]) if record else None,
        )

    def message(self, mid: int, wait: bool = True) -> Message | None:
        """The message with its record; with `wait` False, None instead of reading a record past
        RECORDS_AT_ONCE that read_later is reading now (it is kept when read: ask again then)."""
        row = self.db.execute("SELECT * FROM messages WHERE id=?", (mid,)).fetchone()
        text = row["trace"] if row is not None else None
        if not wait and self._records.readers and text and len(text) > RECORDS_AT_ONCE:
            if not self._records.held(mid, text):
                return None
        return self._message(row)

    def head(self, mid: int) -> Message:
        """A message without its record (trace None): what the buttons ask of the leaf, however big its record."""
        row = self.db.execute(f"SELECT {HEAD_COLUMNS}, NULL AS trace FROM messages WHERE id=?", (mid,)).fetchone()
        return self._message(row)

    def add_message(
        self,
        cid: int,
        parent_id: int | None,
        role: str,
        content: str,
        status: str = "complete",
        token_count: int | None = None,
    ) -> Message:
        cur = self._write(
            "INSERT INTO messages(conversation_id, parent_id, role, content, status, token_count,"
            " created) VALUES (?,?,?,?,?,?,?)",
            (cid, parent_id, role, content, status, token_count, time.time()),
        )
        self._message_writes += 1
        self.set_leaf(cid, cur.lastrowid)
        m = self.message(cur.lastrowid)
        self._kept_added(m)
        return m

    def update_message(
        self,
        mid: int,
        *,
        content: str | None = None,
        status: str | None = None,
        token_count: int | None = None,
        trace: dict | None = None,
    ) -> None:
        cols = {
            c: v for c, v in (("content", content), ("status", status), ("token_count", token_count)) if v is not None
        }
        changes = dict(cols)
        if trace is not None:
            cols["trace"], changes["trace"] = json.dumps(trace), trace
        if cols:
            self._update("messages", mid, **cols)
            self._message_writes += 1
            self._kept_changed(mid, changes)

    def all_messages(self, cid: int) -> list[Message]:
        """Every message of a conversation, every branch, oldest first (parents before children)."""
        rows = self.db.execute("SELECT * FROM messages WHERE conversation_id=? ORDER BY id", (cid,)).fetchall()
        return [self._message(r) for r in rows]

    def branch(self, cid: int) -> list[Message]:
        """The messages from the root to the conversation's current leaf (read once, then kept: see _Kept)."""
        kept = self._kept_for(cid)
        return [] if kept is None else list(kept.path)

    def versions(self, cid: int) -> MappingProxyType:
        """Each message's place among its versions (same parent, same role): id -> (index, how many),
        for the whole conversation."""
        kept = self._kept_for(cid)
        return MappingProxyType({} if kept is None else kept.versions)

    def kept(self, cid: int) -> bool:
        """Whether the conversation's current branch is read already (branch() and versions() cost no read)."""
        k = self._branches.get(cid)
        return k is not None and k.leaf == self.conversation(cid).leaf_id

    def tail(self, cid: int, n: int) -> list[tuple[Message, int, int]] | None:
        """The branch's last `n` messages with their places among their versions, read at once however
        long the conversation (a long one is drawn from its end while read_later reads the rest); past
        RECORDS_AT_ONCE of records, without them (read_later reads those too). None when the branch is no
        longer than that and its records small (branch() reads it whole as cheaply)."""
        leaf = self.conversation(cid).leaf_id
        if leaf is None:
            return None
        rows = self.db.execute(WALK_UP + "ORDER BY path.depth DESC", (leaf, n)).fetchall()
        big = sum(len(r["trace"] or "") for r in rows) > RECORDS_AT_ONCE
        if len(rows) <= n and not big:
            return None
        last = [self._message(r, record=not big) for r in (rows[1:] if len(rows) > n else rows)]
        parents = {m.parent_id for m in last}
        marks = ",".join("?" * len(parents))
        groups = _version_groups(
            self.db.execute(
                f"SELECT id, parent_id, role FROM messages WHERE conversation_id=? AND (parent_id IN ({marks}) "
                "OR parent_id IS NULL) ORDER BY id",
                (cid, *parents),
            )
        )
        return [(m, groups[m.parent_id, m.role].index(m.id), len(groups[m.parent_id, m.role])) for m in last]

    def read_later(self, cid: int) -> Future | None:
        """Read the conversation's branch on a thread of its own, with its own connection to the file (the
        GUI thread goes on drawing); the future's result goes to adopt() on this store's thread. None where
        it cannot be read that way (a temporary database in memory, a file that cannot be opened again)."""
        leaf = self.conversation(cid).leaf_id
        if leaf is None or self.path.name == ":memory:" or not self.path.exists():
            return None
        fut: Future = Future()
        started = self._message_writes

        def read():
            try:
                db = self._open_read_only()
                try:
                    kept = self._read_kept(db, cid, leaf)
                finally:
                    db.close()
            except Exception as e:  # the GUI thread reads it itself then
                kept = e
            finally:
                self._records.reading(-1)
            fut.set_exception(kept) if isinstance(kept, Exception) else fut.set_result((cid, started, kept))

        self._records.reading(+1)
        threading.Thread(target=read, name="kvchat-branch-read", daemon=True).start()
        return fut

    def adopt(self, result) -> bool:
        """Keep a branch read_later read, unless a message was written since it began or the conversation
        moved to another leaf (then branch() reads it again); whether it was kept."""
        cid, started, kept = result
        if started != self._message_writes or kept.leaf != self.conversation(cid).leaf_id:
            return False
        self._keep(cid, kept)
        return True

    def _kept_for(self, cid: int) -> _Kept | None:
        """The conversation's branch and versions: kept from an earlier read and brought to the current
        leaf (a new message, an edit, another version chosen: only the messages below where the branches
        part are read), or read whole."""
        leaf = self.conversation(cid).leaf_id  # as it reads with held-back changes
        if leaf is None:
            return None
        kept = self._branches.get(cid)
        if kept is not None and kept.leaf != leaf and not self._rebase(kept, leaf):
            kept = None
        if kept is None:
            kept = self._read_kept(self.db, cid, leaf)
        self._keep(cid, kept)
        return kept

    def _keep(self, cid: int, kept: _Kept) -> None:
        """BRANCHES_KEPT conversations' branches, the least recently used out first."""
        self._branches.pop(cid, None)
        self._branches[cid] = kept
        while len(self._branches) > BRANCHES_KEPT:
            del self._branches[next(iter(self._branches))]

    def _read_kept(self, db: sqlite3.Connection, cid: int, leaf: int) -> _Kept:
        """The branch from the root to `leaf` (one query however long; a damaged parent chain that loops
        stops at MAX_DEPTH) and every message's versions (one more), through connection `db`."""
        path = [self._message(r) for r in db.execute(WALK_UP + "ORDER BY path.depth DESC", (leaf, MAX_DEPTH))]
        groups = _version_groups(
            db.execute("SELECT id, parent_id, role FROM messages WHERE conversation_id=? ORDER BY id", (cid,))
        )
        versions = {mid: (i, len(ids)) for ids in groups.values() for i, mid in enumerate(ids)}
        return _Kept(leaf, path, {m.id: i for i, m in enumerate(path)}, groups, versions)

    def _rebase(self, kept: _Kept, leaf: int) -> bool:
        """Bring a kept branch to another leaf by reading up from it to where it meets the kept path (a
        message added, a version chosen); False when that is further than REBASE_MAX (read it whole)."""
        chain: list[Message] = []
        mid: int | None = leaf
        while mid is not None and mid not in kept.at:
            rows = self.db.execute(WALK_UP + "ORDER BY path.depth", (mid, REBASE_STEP)).fetchall()
            if not rows or len(chain) > REBASE_MAX:
                return False
            for r in rows:
                if r["id"] in kept.at:
                    mid = r["id"]
                    break
                chain.append(self._message(r))
            else:
                mid = chain[-1].parent_id  # None: the root, so the branches share nothing
        keep = 0 if mid is None else kept.at[mid] + 1
        for m in kept.path[keep:]:
            del kept.at[m.id]
        kept.path[keep:] = reversed(chain)
        for i in range(keep, len(kept.path)):
            kept.at[kept.path[i].id] = i
        kept.leaf = leaf
        return True

    def _kept_added(self, m: Message) -> None:
        """A new message is one more version in its group (the path reaches it when it is the leaf)."""
        kept = self._branches.get(m.conversation_id)
        if kept is not None:
            group = kept.groups.setdefault((m.parent_id, m.role), [])
            group.append(m.id)
            for i, mid in enumerate(group):
                kept.versions[mid] = (i, len(group))

    def _kept_changed(self, mid: int, changes: dict) -> None:
        """A message's new content, status, token count or trace, in the branches kept that hold it."""
        for kept in self._branches.values():
            i = kept.at.get(mid)
            if i is not None:
                kept.path[i] = dataclasses.replace(kept.path[i], **changes)

    def siblings(self, m: Message) -> list[Message]:
        """Versions of this message (same parent, same role), oldest first."""
        if m.parent_id is None:
            rows = self.db.execute(
                "SELECT * FROM messages WHERE conversation_id=? AND parent_id IS NULL AND role=? ORDER BY id",
                (m.conversation_id, m.role),
            ).fetchall()
        else:
            rows = self.db.execute(
                "SELECT * FROM messages WHERE parent_id=? AND role=? ORDER BY id", (m.parent_id, m.role)
            ).fetchall()
        return [self._message(r) for r in rows]

    def deepest_leaf(self, mid: int) -> int:
        """Follow the newest child down from a message: where switching to this branch lands."""
        while True:
            r = self.db.execute("SELECT id FROM messages WHERE parent_id=? ORDER BY id DESC LIMIT 1", (mid,)).fetchone()
            if r is None:
                return mid
            mid = r["id"]
