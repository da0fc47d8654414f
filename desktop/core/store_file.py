"""The conversation database as a file, opened so that nothing the person wrote is lost or hidden: inspected
read-only before anything is written to it, kvchat's older schemas migrated, a damaged or foreign file moved
aside untouched, a read-only one shown read-only, and changes another program's lock holds back kept (in
memory, then beside the file) until they can be written. No Qt here."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from pathlib import Path

TABLES = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    leaf_id INTEGER,
    deleted INTEGER NOT NULL DEFAULT 0,
    settings TEXT
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
"""
INDEXES = "CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(conversation_id, parent_id);"
# Full-text search over message bodies (SQLite FTS5, kept by triggers; where this SQLite lacks FTS5 the
# search falls back to LIKE over the bodies).
FULL_TEXT = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(content, content='messages', content_rowid='id');
CREATE TRIGGER IF NOT EXISTS messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
END;
CREATE TRIGGER IF NOT EXISTS messages_fts_update AFTER UPDATE OF content ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
"""
SCHEMA = TABLES + INDEXES


def _full_text(db: sqlite3.Connection) -> bool:
    """The message search index (made and filled once for a database that lacks it); False where this
    SQLite has no FTS5."""
    have = db.execute("SELECT 1 FROM sqlite_master WHERE name='messages_fts'").fetchone()
    try:
        db.executescript(FULL_TEXT)
    except sqlite3.OperationalError:  # no FTS5 in this SQLite
        return False
    if not have:
        db.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
    return True


BUSY_MS = 50  # how long a write waits for another program's lock before it is held back (the GUI thread waits)
HELD_SUFFIX = ".held.json"  # beside the database: changes a lock held back when the app closed


def _locked(e: Exception) -> bool:
    return "locked" in str(e).lower() or "busy" in str(e).lower()


# SQLite's primary result codes kvchat tells apart (the low byte of sqlite_errorcode)
SQLITE_IOERR, SQLITE_CORRUPT, SQLITE_FULL, SQLITE_NOTADB = 10, 11, 13, 26
DAMAGED = {SQLITE_CORRUPT, SQLITE_NOTADB}  # the file itself is bad; every other error is the disk's or the OS's


def _code(e: sqlite3.Error) -> int | None:
    code = getattr(e, "sqlite_errorcode", None)  # Python 3.11+
    return None if code is None else code & 0xFF


def _damaged(e: sqlite3.Error) -> bool:
    if _code(e) is not None:
        return _code(e) in DAMAGED
    return "malformed" in str(e) or "not a database" in str(e)


def _full(e: sqlite3.Error) -> bool:
    return _code(e) == SQLITE_FULL or "full" in str(e)


def _passing(e: sqlite3.Error) -> str | None:
    """Why a change must wait, when it is something that passes (a lock, a full disk), else None."""
    if _locked(e):
        return "the conversation database is locked by another program"
    return "the disk is full" if _full(e) else None


def _said(e: sqlite3.Error) -> str:
    """An SQLite error as a person reads it: a full disk and a failing disk say so."""
    if _full(e):
        return "the disk is full"
    if _code(e) == SQLITE_IOERR:
        return "the disk could not be read or written (disk I/O error: is it full, or gone?)"
    return str(e)


def _connect(target: str, **kw) -> sqlite3.Connection:
    """A connection that reads rows by column name, in autocommit (kvchat opens its transactions itself)."""
    db = sqlite3.connect(target, timeout=2.0, isolation_level=None, **kw)
    db.row_factory = sqlite3.Row
    return db


def _set_columns(db: sqlite3.Connection, table: str, rid: int, cols: dict) -> None:
    """UPDATE one row's columns by id (the one spelling of a change, written now, later or to a copy)."""
    db.execute(f"UPDATE {table} SET {', '.join(f'{c}=?' for c in cols)} WHERE id=?", (*cols.values(), rid))


class StoreError(Exception):
    """The database cannot be used; the message says what happened and what was done about it."""


SCHEMA_VERSION = 1  # PRAGMA user_version of the schema above; 0: a kvchat database from before versions
COLUMNS = {  # what each table must have; a kvchat database missing a later column is migrated, not moved
    "conversations": {"id", "title", "created", "updated", "leaf_id", "deleted", "settings"},
    "messages": {"id", "conversation_id", "parent_id", "role", "content", "status", "token_count", "created", "trace"},
}
MIGRATIONS = {  # column -> how an older kvchat database gains it, keeping every row
    ("conversations", "leaf_id"): "ALTER TABLE conversations ADD COLUMN leaf_id INTEGER",
    ("conversations", "deleted"): "ALTER TABLE conversations ADD COLUMN deleted INTEGER NOT NULL DEFAULT 0",
    ("conversations", "settings"): "ALTER TABLE conversations ADD COLUMN settings TEXT",
    ("messages", "status"): "ALTER TABLE messages ADD COLUMN status TEXT NOT NULL DEFAULT 'complete'",
    ("messages", "token_count"): "ALTER TABLE messages ADD COLUMN token_count INTEGER",
    ("messages", "trace"): "ALTER TABLE messages ADD COLUMN trace TEXT",
}


class _Unusable(Exception):
    """The file is not a usable kvchat database: corrupt, or another program's."""


class _Unreadable(Exception):
    """The file could not be read now (a full or failing disk, permissions): it is left where it is."""


class _Newer(Exception):
    """The file is a kvchat database of a later layout than this kvchat knows: shown, never changed."""


class StoreFile:
    """The database file, opened defensively: a file is inspected read-only before anything is written to
    it; kvchat's own older schemas are migrated; a corrupt or foreign file is moved aside untouched (never
    overwritten); a file or folder that cannot be written is opened read-only, or a temporary database is
    used, and `notice` says which, for the window to show. Writes go through _write (a row needed now) and
    _update (a change that a lock may hold back)."""

    def __init__(self, path: Path | str, connect_only: bool = False):
        """`connect_only`: a second connection to a database another StoreFile opened (for a thread of
        its own: an import), without the opening steps, which ran there."""
        self.path = Path(path)
        self.moved_aside: Path | None = None
        self.backup: Path | None = None  # a copy made before the layout was changed
        self.read_only = False
        self.temporary = False  # the file could not be used: a database in memory stands in
        self.fts = False  # message search by FTS5 (else LIKE)
        self.notice: str | None = None  # what the person must know about this database, if anything
        # Changes another program's lock held back: (table, id) -> {column: value}, written by flush();
        # reads see them as if written. `on_held(n)` is told when changes are held back.
        self.held: dict[tuple[str, int], dict] = {}
        self.held_because = "the conversation database is locked by another program"  # why they wait
        self.on_held = None
        if str(path) == ":memory:":
            self.db = self._open_writable(":memory:")
            return
        if connect_only:
            self.db = _connect(str(self.path), check_same_thread=False)
            self.db.execute(f"PRAGMA busy_timeout={BUSY_MS * 40}")  # a thread of its own may wait for the lock
            self.fts = bool(self.db.execute("SELECT 1 FROM sqlite_master WHERE name='messages_fts'").fetchone())
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._temporary(f"its folder cannot be made ({e.strerror})")
            return
        try:
            if self.path.exists() and self.path.stat().st_size > 0:
                self._inspect()
            self.db = self._open_writable()
            self._recover_streaming()
            self._replay_held()
        except _Unusable as e:
            self._move_aside(str(e))
        except _Newer as e:
            self._read_only_or_temporary(str(e), newer=True)
        except _Unreadable as e:
            self._read_only_or_temporary(str(e))
        except sqlite3.DatabaseError as e:
            if _locked(e):
                raise StoreError(
                    f"the conversation database {self.path} is locked by another program; "
                    "close it (or another kvchat) and try again"
                ) from None
            self._read_only_or_temporary(_said(e))

    # --- opening -------------------------------------------------------------------------------
    def _inspect(self) -> None:
        """Look at an existing file without changing a byte: integrity, then whose schema it is."""
        try:
            ro = self._open_read_only()
        except sqlite3.DatabaseError as e:
            if not _damaged(e):
                raise _Unreadable(_said(e)) from None
            raise _Unusable(f"it cannot be opened ({e})") from None
        try:
            version = ro.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise _Newer(f"its layout is version {version}; this kvchat knows up to {SCHEMA_VERSION}")
            check = ro.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise _Unusable(f"it is damaged ({check})")
            tables = {r[0] for r in ro.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not set(COLUMNS) & tables and tables - {"sqlite_sequence"}:
                raise _Unusable(f"it is another program's database (tables: {', '.join(sorted(tables))})")
            migrating = False  # a column to add: the layout changes
            for table in set(COLUMNS) & tables:
                have = {r[1] for r in ro.execute(f"PRAGMA table_info({table})")}
                missing = COLUMNS[table] - have - {c for (t, c) in MIGRATIONS if t == table}
                if missing:
                    raise _Unusable(f"its {table} table lacks {', '.join(sorted(missing))}")
                migrating = migrating or bool(COLUMNS[table] - have)
            if migrating or (tables & set(COLUMNS) and version < SCHEMA_VERSION):
                self._back_up(ro)
        except sqlite3.DatabaseError as e:
            if _locked(e):
                raise
            if not _damaged(e):
                raise _Unreadable(_said(e)) from None
            raise _Unusable(f"it is damaged or not a database ({e})") from None
        finally:
            ro.close()

    def _back_up(self, ro: sqlite3.Connection) -> None:
        """A copy of the file as it is, beside it, before kvchat changes its layout."""
        aside = self.path.with_name(f"{self.path.name}.before-v{SCHEMA_VERSION}-{time.strftime('%Y%m%d-%H%M%S')}")
        dst = sqlite3.connect(str(aside))
        try:
            ro.backup(dst)
        finally:
            dst.close()
        self.backup = aside
        self.notice = f"kvchat updated the conversation database's layout; a copy of it as it was is at {aside}."

    def _open_read_only(self) -> sqlite3.Connection:
        """The file as it is: sqlite changes nothing in it (no journal mode, no schema)."""
        return _connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)

    def _open_writable(self, where: str | None = None) -> sqlite3.Connection:
        """This store's file (or `where`: ":memory:" for a temporary database), with kvchat's schema."""
        db = _connect(where or str(self.path))
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(TABLES)  # if new
        for (table, column), sql in MIGRATIONS.items():  # kvchat's older schemas: add what they lack
            if column not in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
                db.execute(sql)
        db.executescript(INDEXES)
        self.fts = _full_text(db)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.execute("SELECT count(*) FROM conversations").fetchone()
        db.execute(f"PRAGMA busy_timeout={BUSY_MS}")  # opened: from now on a lock holds a change back, briefly
        return db

    def _move_aside(self, why: str) -> None:
        """A file that is not a usable kvchat database is renamed, untouched, and a new one started."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.unreadable-{stamp}")
        try:
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                side = Path(str(self.path) + suffix)
                if side.exists():
                    os.replace(side, str(aside) + suffix)
        except OSError as e:
            self._temporary(f"{why}, and it cannot be moved aside ({e.strerror}); it was left as it is")
            return
        self.moved_aside = aside
        try:
            self.db = self._open_writable()
        except sqlite3.DatabaseError as e:
            self._temporary(f"{why}; it was moved aside to {aside}, but a new one cannot be made there ({e})")
            return
        self.notice = (
            f"The conversation database could not be used ({why}), so it was moved aside to {aside} "
            "(nothing was overwritten) and a new one was started."
        )

    def _read_only_or_temporary(self, why: str, newer: bool = False) -> None:
        """A database that cannot be written now (a read-only folder or file, a full or failing disk, a
        later kvchat's layout): left where it is, its conversations shown read-only; with nothing to read,
        a temporary database."""
        try:
            db = self._open_read_only()
            db.execute("SELECT count(*) FROM conversations").fetchone()
        except sqlite3.DatabaseError as e:
            self._temporary(f"it cannot be read now ({why}; {_said(e)}). It was left where it is, unchanged")
            return
        self.db, self.read_only = db, True
        if newer:
            self.notice = (
                f"The conversation database {self.path} was made by a newer kvchat ({why}): your conversations "
                "are shown read-only so that nothing in it is changed, and what you send now is not saved."
            )
            return
        self.notice = (
            f"The conversation database {self.path} cannot be written ({why}): your conversations "
            "are shown read-only, and what you send now is not saved."
        )

    def _temporary(self, why: str) -> None:
        self.db = self._open_writable(":memory:")
        self.temporary = True
        self.notice = (
            f"The conversation database {self.path} cannot be used: {why}. kvchat runs on a temporary "
            "database: what you send now is not saved."
        )

    def _recover_streaming(self) -> None:
        """Replies that were streaming when the app died are kept, marked incomplete."""
        self._write("UPDATE messages SET status='incomplete' WHERE status='streaming'")
        self.forget_branches()

    def _writable(self) -> None:
        """Refuse a change to a read-only database."""
        if self.read_only:
            raise StoreError("the conversation database is read-only here: your last change was not saved")

    def _write(self, sql: str, args=()) -> sqlite3.Cursor:
        """A write that makes a row (its id is needed now): refused with a message while locked."""
        self._writable()
        try:
            return self.db.execute(sql, args)
        except sqlite3.DatabaseError as e:
            if _locked(e):
                raise StoreError(
                    "the conversation database is locked by another program; your last change was not saved"
                ) from None
            raise StoreError(f"the conversation database refused the change ({_said(e)}); it was not saved") from None

    @contextlib.contextmanager
    def transaction(self):
        """Everything written inside happens together or not at all (an import killed halfway leaves
        nothing); on failure what the store keeps of its branches is forgotten, as if re-read."""
        self._writable()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as e:
            raise StoreError(f"the conversation database cannot be written now ({_said(e)})") from None
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            self.forget_branches()
            raise

    def _update(self, table: str, rid: int, **cols) -> None:
        """A change to a row's columns. While another program holds the database it is held back (each
        column's latest value), reads see it as if written, and flush() writes it: a reply streaming
        during a lock is neither lost nor stalls the window for more than BUSY_MS."""
        self._writable()
        if not self.held:
            try:
                _set_columns(self.db, table, rid, cols)
                return
            except sqlite3.DatabaseError as e:
                self.held_because = _passing(e)
                if self.held_because is None:
                    raise StoreError(f"the conversation database refused the change ({_said(e)})") from None
        self.held.setdefault((table, rid), {}).update(cols)
        if self.on_held is not None:
            self.on_held(len(self.held))

    def flush(self) -> bool:
        """Write the changes a lock held back, in one transaction; False while the database is still
        locked (they stay held)."""
        if not self.held:
            return True
        try:
            self.db.execute("BEGIN IMMEDIATE")
            for (table, rid), cols in self.held.items():
                _set_columns(self.db, table, rid, cols)
            self.db.execute("COMMIT")
        except sqlite3.DatabaseError as e:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            if _passing(e):
                self.held_because = _passing(e)
                return False
            raise StoreError(f"the conversation database failed: {_said(e)}") from None
        self.held.clear()
        return True

    def save_copy(self, path: Path | str) -> Path:
        """The whole database with the held-back changes in it, written to another file (the banner's
        "Save a copy elsewhere…"); the working database stays this one."""
        path = Path(path)
        try:
            if path.exists():
                path.unlink()
            dst = sqlite3.connect(str(path), isolation_level=None)
            try:
                self.db.backup(dst)
                for (table, rid), cols in self.held.items():
                    _set_columns(dst, table, rid, cols)
            finally:
                dst.close()
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"a copy could not be written to {path}: {e}") from None
        return path

    @property
    def held_path(self) -> Path:
        return self.path.with_name(self.path.name + HELD_SUFFIX)

    def _replay_held(self) -> None:
        """Changes a lock held back when kvchat last closed (kept in a file beside the database): written
        now, and the file removed; a damaged file is moved aside and said so."""
        path = self.held_path
        if not path.exists():
            return
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
            held = {(r["table"], int(r["id"])): dict(r["columns"]) for r in rows if r["table"] in COLUMNS}
            for (table, _), cols in held.items():
                if not set(cols) <= COLUMNS[table] - {"id"}:
                    raise ValueError(f"unknown columns {sorted(set(cols) - COLUMNS[table])}")
        except (OSError, ValueError, TypeError, KeyError) as e:
            aside = path.with_name(path.name + f".unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, aside)
            self.notice = (
                f"Changes held back from the last session could not be read ({e}); the file was moved to {aside}."
            )
            return
        self.held.update(held)
        if self.flush():
            path.unlink()
            self.notice = (
                f"{len(held)} change{'s' if len(held) != 1 else ''} that another program's lock held back when "
                "kvchat last closed were saved now."
            )

    def close(self) -> bool:
        """Close; changes a lock still holds back are written to a file beside the database (saved on the
        next start). False if even that failed (the caller says so)."""
        kept = True
        if self.held and not self.flush() and self.path.name != ":memory:":
            try:
                rows = [{"table": t, "id": rid, "columns": cols} for (t, rid), cols in self.held.items()]
                self.held_path.write_text(json.dumps(rows), encoding="utf-8")
            except OSError:
                kept = False
        self.db.close()
        return kept

    def forget_branches(self) -> None:
        """What a subclass keeps of the messages read is stale (the file changed under it)."""
