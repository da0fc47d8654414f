"""The conversation database opened as a person's disk leaves it: damaged, from an older kvchat,
another program's, in a folder that cannot be written. Start-up never aborts, nothing is
overwritten, and the notice says what was done."""

import dataclasses
import hashlib
import os
import sqlite3

import pytest

from desktop.core.store import Store
from desktop.core.store_file import SCHEMA_VERSION, StoreError


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def filled(path, n=300):
    """A kvchat database with enough rows to span many pages."""
    st = Store(path)
    c = st.new_conversation("Trip")
    parent = None
    for i in range(n):
        parent = st.add_message(c.id, parent and parent.id, "user" if i % 2 == 0 else "assistant", f"message {i} " * 20)
    st.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    st.close()
    return c.id


def test_corrupt_pages_in_the_middle_are_moved_aside_untouched(tmp_path):
    path = tmp_path / "kvchat.db"
    filled(path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8192] = b"\xde\xad\xbe\xef" * 2048  # garbage over two pages in the middle
    path.write_bytes(bytes(data))
    before = digest(path)
    st = Store(path)
    assert st.moved_aside is not None and digest(st.moved_aside) == before
    assert "damaged" in st.notice and str(st.moved_aside) in st.notice and "nothing was overwritten" in st.notice
    assert st.conversations() == [] and st.new_conversation("fresh").title == "fresh"


def test_an_older_kvchat_schema_is_migrated_keeping_every_row(tmp_path):
    path = tmp_path / "kvchat.db"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL,
                                    created REAL NOT NULL, updated REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id INTEGER NOT NULL,
                               parent_id INTEGER, role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL);
        INSERT INTO conversations(title, created, updated) VALUES ('Old trip', 1, 2);
        INSERT INTO messages(conversation_id, parent_id, role, content, created) VALUES (1, NULL, 'user', 'hi', 1);
        """
    )
    db.commit()
    db.close()
    st = Store(path)
    assert st.moved_aside is None and st.backup is not None and str(st.backup) in st.notice
    old = sqlite3.connect(st.backup)  # the copy made before the layout changed is the old layout, every row
    assert {r[1] for r in old.execute("PRAGMA table_info(conversations)")} == {"id", "title", "created", "updated"}
    assert old.execute("SELECT content FROM messages").fetchall() == [("hi",)]
    old.close()
    [conv] = st.conversations()
    assert conv.title == "Old trip" and conv.leaf_id is None
    assert st.message(1).content == "hi" and st.message(1).status == "complete"
    assert st.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    st.set_leaf(conv.id, 1)
    assert [m.content for m in st.branch(conv.id)] == ["hi"]


def test_another_programs_database_is_moved_aside_byte_for_byte(tmp_path):
    path = tmp_path / "kvchat.db"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT); INSERT INTO notes VALUES (1, 'mine');")
    db.commit()
    db.close()
    before = digest(path)
    st = Store(path)
    assert st.moved_aside is not None and digest(st.moved_aside) == before  # not switched to WAL first
    assert "another program's database (tables: notes)" in st.notice


def test_a_database_that_cannot_be_written_is_shown_read_only(tmp_path, monkeypatch):
    """A read-only folder (simulated: the tests run as root, whom file modes do not stop)."""
    path = tmp_path / "kvchat.db"
    cid = filled(path, 4)
    real = Store._open_writable

    def readonly(self, where=None):
        if where != ":memory:":  # the file (a temporary database in memory still works)
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return real(self, where)

    monkeypatch.setattr(Store, "_open_writable", readonly)
    st = Store(path)
    assert st.read_only and "read-only" in st.notice and st.moved_aside is None
    assert [c.id for c in st.conversations()] == [cid] and len(st.branch(cid)) == 4  # every message readable
    with pytest.raises(StoreError, match="read-only"):
        st.add_message(cid, None, "user", "new")


def test_a_broken_file_that_cannot_be_moved_is_left_alone(tmp_path, monkeypatch):
    path = tmp_path / "kvchat.db"
    path.write_bytes(b"not a database at all" * 100)
    before = digest(path)

    def refuse(*_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("desktop.core.store_file.os.replace", refuse)
    st = Store(path)
    assert digest(path) == before and st.moved_aside is None
    assert "cannot be moved aside (Permission denied); it was left as it is" in st.notice
    assert "temporary database" in st.notice and st.new_conversation("x").title == "x"


def test_a_folder_that_cannot_be_made_gives_a_temporary_database(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    st = Store(blocker / "sub" / "kvchat.db")  # its parent is a file: the folder cannot be made
    assert "its folder cannot be made" in st.notice and st.new_conversation("x").title == "x"


def test_search_finds_words_in_message_bodies_of_any_branch_and_follows_edits(tmp_path):
    st = Store(tmp_path / "kvchat.db")
    assert st.fts
    trip = st.new_conversation("Trip")
    u = st.add_message(trip.id, None, "user", "Plan three nights in Chengdu")
    a = st.add_message(trip.id, u.id, "assistant", "Visit the giant pandas at dawn")
    st.add_message(trip.id, None, "user", "A branch about teahouses")  # a sibling branch, not shown
    other = st.new_conversation("Recipes")
    st.add_message(other.id, None, "user", "How long to boil an egg?")
    titles = lambda q: [c.title for c in st.conversations(q)]
    assert titles("panda") == ["Trip"]  # a prefix of a word in a reply
    assert titles("teahouses") == ["Trip"] and titles("egg") == ["Recipes"] and titles("reci") == ["Recipes"]
    assert titles("giant dawn") == ["Trip"] and titles("giant egg") == []  # every word
    assert titles('"quoted') == [] and titles("") == ["Recipes", "Trip"]
    hits = st.search_hits("teahouse")  # the message that matched, and its words around the match
    assert list(hits) == [trip.id] and hits[trip.id].message_id == u.id + 2
    assert hits[trip.id].snippet == "…branch about teahouses"  # the match comes early: the list is narrow
    long = st.add_message(other.id, None, "user", " ".join(f"w{i}" for i in range(40)) + " soufflé " + "x " * 40)
    snip = st.search_hits("souff")[other.id]
    assert snip.message_id == long.id and "soufflé" in snip.snippet and snip.snippet.startswith("…")
    assert snip.snippet.endswith("…") and len(snip.snippet.split()) <= 10
    st.fts = False  # the LIKE path (SQLite without FTS5) gives the same hits
    assert st.search_hits("teahouse")[trip.id] == hits[trip.id]
    assert "soufflé" in st.search_hits("souff")[other.id].snippet and st.search_hits("") == {}
    st.fts = True
    st.update_message(a.id, content="Visit the bamboo forest")  # the index follows the edit
    assert titles("panda") == [] and titles("bamboo") == ["Trip"]
    assert st.search_hits("bamboo")[trip.id].message_id == a.id
    st.close()


def test_a_database_from_before_the_search_index_is_indexed_when_opened(tmp_path):
    path = tmp_path / "kvchat.db"
    filled(path, n=10)
    db = sqlite3.connect(path)
    db.executescript("DROP TRIGGER messages_fts_insert; DROP TRIGGER messages_fts_delete; "
                     "DROP TRIGGER messages_fts_update; DROP TABLE messages_fts;")  # fmt: skip
    db.close()
    st = Store(path)
    assert [c.title for c in st.conversations("message")] == ["Trip"]


def test_a_conversation_keeps_its_own_settings_and_an_older_database_gains_the_column(tmp_path):
    path = tmp_path / "kvchat.db"
    filled(path, n=4)
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE conversations DROP COLUMN settings")  # as kvchat wrote it before
    db.commit()
    db.close()
    st = Store(path)
    conv = st.conversations()[0]
    assert conv.settings is None and st.moved_aside is None  # migrated, not moved aside
    st.set_settings(conv.id, {"system_prompt": "Be brief.", "temperature": 0.5})
    assert st.conversation(conv.id).settings == {"system_prompt": "Be brief.", "temperature": 0.5}
    made = st.new_conversation("Other", {"top_k": 40})
    assert st.conversation(made.id).settings == {"top_k": 40}


def lock(path):
    """Another program holding the database: an exclusive write transaction on its own connection."""
    holder = sqlite3.connect(str(path), isolation_level=None, timeout=0)
    holder.execute("BEGIN EXCLUSIVE")
    return holder


def test_changes_a_lock_holds_back_read_as_written_and_are_saved_when_it_goes(tmp_path):
    import time

    path = tmp_path / "kvchat.db"
    st = Store(path)
    told = []
    st.on_held = told.append
    conv = st.new_conversation("Trip")
    u = st.add_message(conv.id, None, "user", "Plan three nights")
    a = st.add_message(conv.id, u.id, "assistant", "", status="streaming")
    holder = lock(path)
    t0 = time.perf_counter()
    st.update_message(a.id, content="Day one: pandas")  # a reply streaming while another program holds it
    st.update_message(a.id, content="Day one: pandas. Day two: tea", status="complete", token_count=9)
    st.rename(conv.id, "Chengdu")
    assert time.perf_counter() - t0 < 1.0  # held back, not waited on (BUSY_MS once, then straight to memory)
    assert told and told[-1] == 2 and len(st.held) == 2
    m = st.message(a.id)  # reads see them as if written
    assert (m.content, m.status, m.token_count) == ("Day one: pandas. Day two: tea", "complete", 9)
    assert st.branch(conv.id)[-1].content == m.content and st.conversations()[0].title == "Chengdu"
    with pytest.raises(StoreError, match="locked"):  # a new row needs its id now: refused, with the reason
        st.add_message(conv.id, a.id, "user", "And day three?")
    assert not st.flush() and len(st.held) == 2  # still locked: kept
    other = sqlite3.connect(str(path))
    copy = st.save_copy(tmp_path / "copy.db")  # the way out, while it lasts: a copy with every change
    row = sqlite3.connect(str(copy)).execute("SELECT content, status FROM messages WHERE id=?", (a.id,)).fetchone()
    assert row == ("Day one: pandas. Day two: tea", "complete")
    holder.rollback()
    holder.close()
    assert st.flush() and st.held == {}
    row = other.execute("SELECT content, status, token_count FROM messages WHERE id=?", (a.id,)).fetchone()
    assert row == ("Day one: pandas. Day two: tea", "complete", 9)
    assert other.execute("SELECT title FROM conversations").fetchone()[0] == "Chengdu"
    st.close()


def test_changes_still_held_at_close_are_kept_beside_the_database_and_saved_at_the_next_start(tmp_path):
    path = tmp_path / "kvchat.db"
    st = Store(path)
    conv = st.new_conversation("Trip")
    a = st.add_message(conv.id, None, "user", "draft")
    holder = lock(path)
    st.update_message(a.id, content="the final text")
    st.set_leaf(conv.id, a.id)
    assert st.close()  # still locked: written beside the database
    assert st.held_path.exists()
    holder.rollback()
    holder.close()
    st = Store(path)
    assert st.message(a.id).content == "the final text" and not st.held_path.exists()
    assert "2 changes" in st.notice and "saved now" in st.notice
    st.close()
    st = Store(path)  # once
    assert st.notice is None
    st.held_path.write_text('[{"table": "messages", "id": 1, "columns": {"evil; DROP": 1}}]')
    st.close()
    st = Store(path)  # a damaged or forged file is moved aside, never run
    assert "could not be read" in st.notice and st.message(a.id).content == "the final text"
    assert not st.held_path.exists() and list(tmp_path.glob("kvchat.db.held.json.unreadable-*"))
    st.close()


def test_a_branch_read_again_with_nothing_written_is_the_same_and_a_write_is_seen(tmp_path):
    st = Store(tmp_path / "kvchat.db")
    a, b = st.new_conversation("A"), st.new_conversation("B")
    m = st.add_message(a.id, None, "user", "first")
    st.add_message(b.id, None, "user", "other")
    one = st.branch(a.id)
    with pytest.raises(dataclasses.FrozenInstanceError):  # shared with the kept branch: read-only
        one[0].content = "changed by a view"
    st.branch(b.id)  # another conversation read in between
    assert [x.content for x in st.branch(a.id)] == ["first"] and st.versions(a.id) == {m.id: (0, 1)}
    r = st.add_message(a.id, m.id, "assistant", "reply")
    st.update_message(r.id, content="reply, edited")
    assert [x.content for x in st.branch(a.id)] == ["first", "reply, edited"]
    second = st.add_message(a.id, None, "user", "first, edited")  # a second version of the first message
    assert st.versions(a.id)[second.id] == (1, 2) and [x.content for x in st.branch(a.id)] == ["first, edited"]
    st.close()


def _full_reads(st: Store) -> list:
    """The statements that read a whole conversation's versions: one per branch read whole."""
    seen = []
    st.db.set_trace_callback(lambda sql: "ORDER BY id" in sql and "conversation_id=" in sql and seen.append(sql))
    return seen


def test_a_kept_branch_follows_every_change_as_a_fresh_read_sees_it_without_reading_it_again(tmp_path):
    """New messages, edits (new versions), another version chosen, streamed updates: the branch and the
    versions the store keeps equal what another connection reads from the file, and the conversation
    is read whole once."""
    import random

    path = tmp_path / "kvchat.db"
    st = Store(path)
    conv = st.new_conversation("Long")
    parent = None
    for i in range(120):
        parent = st.add_message(conv.id, parent, "user" if i % 2 == 0 else "assistant", f"message {i}").id
    full = _full_reads(st)
    st.branch(conv.id)
    rnd = random.Random(3)
    for step in range(60):
        path_now = st.branch(conv.id)
        m = rnd.choice(path_now)
        op = step % 4
        if op == 0:  # a reply or a question at the end
            last = path_now[-1]
            st.add_message(conv.id, last.id, "assistant" if last.role == "user" else "user", f"new {step}")
        elif op == 1:  # an edit: a new version of a message somewhere up the branch
            st.add_message(conv.id, m.parent_id, m.role, f"{m.content}, edited at {step}")
        elif op == 2:  # another version chosen (‹ ›), down to its newest leaf
            sibs = st.siblings(m)
            st.set_leaf(conv.id, st.deepest_leaf(rnd.choice(sibs).id))
        else:  # a streamed save
            st.update_message(m.id, content=f"{m.content} +", status="complete", token_count=step, trace={"s": step})
        fresh = Store(path)
        assert st.branch(conv.id) == fresh.branch(conv.id), step
        assert dict(st.versions(conv.id)) == dict(fresh.versions(conv.id)), step
        fresh.close()
    assert len(full) == 1  # read whole once; every change after was followed, not read again
    st.close()


def test_a_branch_read_on_another_thread_is_kept_unless_a_message_was_written_meanwhile(tmp_path):
    import threading

    st = Store(tmp_path / "kvchat.db")
    conv = st.new_conversation("Long")
    parent = None
    for i in range(40):
        parent = st.add_message(conv.id, parent, "user" if i % 2 == 0 else "assistant", f"message {i}").id
    st._branches.clear()
    readers = []
    read = Store._read_kept

    def spy(self, db, cid, leaf):
        readers.append(threading.current_thread() is threading.main_thread())
        return read(self, db, cid, leaf)

    st._read_kept = spy.__get__(st)
    tail = st.tail(conv.id, 10)  # the end at once, with each message's place among its versions
    assert [(m.id, i, n) for m, i, n in tail] == [(m.id, 0, 1) for m in Store(st.path).branch(conv.id)[-10:]]
    assert st.tail(conv.id, 40) is None  # no longer than that: read whole as cheaply
    assert not st.kept(conv.id)
    result = st.read_later(conv.id).result(timeout=30)
    assert readers == [False] and st.adopt(result) and st.kept(conv.id)
    assert [m.content for m in st.branch(conv.id)][-1] == "message 39" and readers == [False]
    st._branches.clear()
    later = st.read_later(conv.id)
    st.update_message(parent, content="changed while it was read")
    assert not st.adopt(later.result(timeout=30)) and not st.kept(conv.id)  # stale: read again here
    assert st.branch(conv.id)[-1].content == "changed while it was read" and readers == [False, False, True]
    st.close()


def test_store_tree_branches_and_crash_recovery(tmp_path):
    st = Store(tmp_path / "k.db")
    c = st.new_conversation("Trip")
    u1 = st.add_message(c.id, None, "user", "budget 600")
    a1 = st.add_message(c.id, u1.id, "assistant", "plan 600")
    u2 = st.add_message(c.id, None, "user", "budget 750")  # an edit: a sibling of u1
    a2 = st.add_message(c.id, u2.id, "assistant", "plan 7", status="streaming")
    assert [m.id for m in st.branch(c.id)] == [u2.id, a2.id]
    assert [m.id for m in st.siblings(u2)] == [u1.id, u2.id]
    st.set_leaf(c.id, st.deepest_leaf(u1.id))
    assert [m.content for m in st.branch(c.id)] == ["budget 600", "plan 600"]
    assert st.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    st.db.close()  # the app dies mid-reply, without saving anything more
    st = Store(tmp_path / "k.db")
    assert st.message(a2.id).status == "incomplete" and st.message(a2.id).content == "plan 7"
    assert st.message(a1.id).status == "complete"


def test_a_newer_kvchat_database_is_opened_read_only_and_left_unchanged(tmp_path):
    path = tmp_path / "kvchat.db"
    st = Store(path)
    c = st.new_conversation("from the future")
    st.add_message(c.id, None, "user", "kept")
    st.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=7")
    db.commit()
    db.close()
    before = path.read_bytes()
    st = Store(path)
    assert st.read_only and "made by a newer kvchat" in st.notice and "version 7" in st.notice
    assert [m.content for m in st.all_messages(c.id)] == ["kept"]
    with pytest.raises(StoreError, match="read-only"):
        st.add_message(c.id, None, "user", "new")
    st.close()
    assert path.read_bytes() == before
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 7


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device every write to fails)")
def test_a_disk_error_is_not_damage_the_file_stays_where_it_is(tmp_path):
    """A full disk makes a healthy WAL database fail to open (its shared-memory file cannot be made or
    written): that is the disk, not the file. Here the -shm file is /dev/full. The database is kept where
    it is, never renamed as damaged, the banner says so; once the disk is fine it opens with everything."""
    path = tmp_path / "kvchat.db"
    st = Store(path)
    c = st.new_conversation("keep me")
    st.add_message(c.id, None, "user", "precious")
    st.close()
    before = path.read_bytes()
    shm = tmp_path / "kvchat.db-shm"
    shm.unlink(missing_ok=True)
    shm.symlink_to("/dev/full")
    st = Store(path)
    assert st.moved_aside is None and path.read_bytes() == before and not list(tmp_path.glob("*.unreadable-*"))
    assert "left where it is" in st.notice and "not saved" in st.notice
    st.close()
    shm.unlink()
    st = Store(path)
    assert st.notice is None and [m.content for m in st.all_messages(c.id)] == ["precious"]
    st.close()


def test_a_write_the_database_refuses_is_a_store_error_not_a_crash(tmp_path):
    path = tmp_path / "kvchat.db"
    st = Store(path)
    c = st.new_conversation("t")
    st.db.execute("CREATE TRIGGER no_more BEFORE INSERT ON messages BEGIN SELECT RAISE(ABORT, 'no more messages'); END")
    with pytest.raises(StoreError, match="refused the change.*no more messages"):
        st.add_message(c.id, None, "user", "hi")
    st.close()


def test_search_reads_percent_underscore_and_nul_as_characters(tmp_path):
    st = Store(tmp_path / "kvchat.db")
    for title, text in (("plain", "nothing special"), ("rates", "a 5% rate"), ("snake", "snake_case")):
        c = st.new_conversation(title)
        st.add_message(c.id, None, "user", text)
    assert "plain" not in [c.title for c in st.conversations("%")]  # was: every conversation
    assert [c.title for c in st.conversations("5%")] == ["rates"]
    assert "plain" not in [c.title for c in st.conversations("_")]
    assert [c.title for c in st.conversations("snake\x00_case")] == ["snake"]
    assert st.search_hits("\x00") == {}
    st.fts = False  # the LIKE path too
    assert [c.title for c in st.conversations("%")] == ["rates"]
    assert [c.title for c in st.conversations("_")] == ["snake"]
    st.close()


def test_a_reply_written_while_the_disk_is_full_is_held_and_saved_when_there_is_room(tmp_path):
    """SQLite's page limit gives the real "database or disk is full" error: a streaming reply's text is
    held in memory (read back as written), the reason is the disk, and it is saved once there is room."""
    st = Store(tmp_path / "kvchat.db")
    c = st.new_conversation("t")
    m = st.add_message(c.id, None, "assistant", "", status="streaming")
    pages = st.db.execute("PRAGMA page_count").fetchone()[0]
    st.db.execute(f"PRAGMA max_page_count={pages}")
    told = []
    st.on_held = told.append
    long_text = "a long reply " * 50_000
    st.update_message(m.id, content=long_text)  # no room: held, not raised
    assert told and st.held_because == "the disk is full" and st.message(m.id).content == long_text
    assert not st.flush()
    st.db.execute("PRAGMA max_page_count=1073741823")  # space freed
    assert st.flush() and not st.held
    st.close()
    assert Store(tmp_path / "kvchat.db").message(m.id).content == long_text
