"""Conversations as message trees, persisted in SQLite (WAL). No Qt here: the views adapt it.

Each message has a parent; an edit or a regeneration adds a sibling, so the old branch stays.
A conversation remembers its current leaf; the path from the root to it is what the transcript
shows and what the model sees. Partial replies are written as they stream (status "streaming"),
so a crash loses nothing that was shown; on the next start they read as "incomplete".
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    leaf_id INTEGER,
    deleted INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id),
    parent_id INTEGER REFERENCES messages(id),
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'complete',
    token_count INTEGER,
    created REAL NOT NULL,
    trace TEXT
);
CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(conversation_id, parent_id);
"""


class StoreError(Exception):
    """The database cannot be used; the message says what happened and what was done about it."""


@dataclasses.dataclass
class Message:
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


class Store:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.moved_aside: Path | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = self._open()
        except sqlite3.DatabaseError as e:
            if "locked" in str(e).lower():
                raise StoreError(
                    f"the conversation database {self.path} is locked by another program; "
                    "close it (or another kvchat) and try again"
                ) from None
            # Unreadable: move it aside, never overwrite it, and start a new one.
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.moved_aside = self.path.with_name(f"{self.path.name}.unreadable-{stamp}")
            shutil.move(str(self.path), str(self.moved_aside))
            for suffix in ("-wal", "-shm"):
                side = Path(str(self.path) + suffix)
                if side.exists():
                    shutil.move(str(side), str(self.moved_aside) + suffix)
            self.db = self._open()
        self._recover_streaming()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path), timeout=2.0, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        db.execute("SELECT count(*) FROM conversations").fetchone()
        return db

    def _recover_streaming(self) -> None:
        """Replies that were streaming when the app died are kept, marked incomplete."""
        self._write("UPDATE messages SET status='incomplete' WHERE status='streaming'")

    def _write(self, sql: str, args=()) -> sqlite3.Cursor:
        try:
            return self.db.execute(sql, args)
        except sqlite3.OperationalError as e:
            if "locked" in str(e).lower() or "busy" in str(e).lower():
                raise StoreError(
                    "the conversation database is locked by another program; your last change was not saved"
                ) from None
            raise StoreError(f"the conversation database failed: {e}") from None

    def close(self) -> None:
        self.db.close()

    # --- conversations ------------------------------------------------------------------
    def conversations(self, search: str = "") -> list[Conversation]:
        rows = self.db.execute(
            "SELECT * FROM conversations WHERE deleted=0 AND title LIKE ? ORDER BY updated DESC", (f"%{search}%",)
        ).fetchall()
        return [Conversation(r["id"], r["title"], r["created"], r["updated"], r["leaf_id"]) for r in rows]

    def conversation(self, cid: int) -> Conversation:
        r = self.db.execute("SELECT * FROM conversations WHERE id=?", (cid,)).fetchone()
        return Conversation(r["id"], r["title"], r["created"], r["updated"], r["leaf_id"])

    def new_conversation(self, title: str = "New chat") -> Conversation:
        now = time.time()
        cur = self._write("INSERT INTO conversations(title, created, updated) VALUES (?,?,?)", (title, now, now))
        return self.conversation(cur.lastrowid)

    def rename(self, cid: int, title: str) -> None:
        self._write("UPDATE conversations SET title=?, updated=? WHERE id=?", (title, time.time(), cid))

    def delete(self, cid: int) -> None:
        """Soft delete, so it can be undone."""
        self._write("UPDATE conversations SET deleted=1 WHERE id=?", (cid,))

    def undelete(self, cid: int) -> None:
        self._write("UPDATE conversations SET deleted=0 WHERE id=?", (cid,))

    def set_leaf(self, cid: int, leaf_id: int | None) -> None:
        self._write("UPDATE conversations SET leaf_id=?, updated=? WHERE id=?", (leaf_id, time.time(), cid))

    # --- messages -----------------------------------------------------------------------
    def _message(self, r) -> Message:
        return Message(
            r["id"],
            r["conversation_id"],
            r["parent_id"],
            r["role"],
            r["content"],
            r["status"],
            r["token_count"],
            r["created"],
            json.loads(r["trace"]) if r["trace"] else None,
        )

    def message(self, mid: int) -> Message:
        return self._message(self.db.execute("SELECT * FROM messages WHERE id=?", (mid,)).fetchone())

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
        self.set_leaf(cid, cur.lastrowid)
        return self.message(cur.lastrowid)

    def update_message(
        self,
        mid: int,
        *,
        content: str | None = None,
        status: str | None = None,
        token_count: int | None = None,
        trace: dict | None = None,
    ) -> None:
        sets, args = [], []
        for col, val in (("content", content), ("status", status), ("token_count", token_count)):
            if val is not None:
                sets.append(f"{col}=?")
                args.append(val)
        if trace is not None:
            sets.append("trace=?")
            args.append(json.dumps(trace))
        if sets:
            self._write(f"UPDATE messages SET {', '.join(sets)} WHERE id=?", (*args, mid))

    def branch(self, cid: int) -> list[Message]:
        """The messages from the root to the conversation's current leaf."""
        conv = self.conversation(cid)
        out, mid = [], conv.leaf_id
        while mid is not None:
            m = self.message(mid)
            out.append(m)
            mid = m.parent_id
        return out[::-1]

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
