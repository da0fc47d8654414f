"""A reply's stored record (its trace, reuse, cache, made_by and tokens) as data the app can show: every field
checked for its type, range and size where it is read from the store or an import, so a hostile or damaged
record is shown as unreadable, never raised in a slot, and a big one is cut before it reaches a widget."""

from __future__ import annotations

import json
import math
import threading

from engine.errors import cut
from engine.state_cache import SCANNING  # the state layers that scan (Mamba-2, a gated DeltaNet)
from engine.tool_calls import MAX_CALLS  # calls in one reply's record

from .image_files import checked_references

STRING_CHARS = 2000  # an error, a reason, a model's name
TOKEN_CHARS = 200  # one token's text
LIST_ITEMS = 100_000  # a trace's lists (token times, gaps)
MAX_TOKENS = 65_536  # a reply's token records
MAX_TOP = 20  # alternatives per token (engine.logprobs.MAX_TOP_LOGPROBS)
MAX_KEYS = 200
DEPTH = 4
RECORDS_KEPT = 32  # records a store keeps checked (CheckedRecords)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def plain(value, depth: int = 0):
    """JSON data bounded: finite numbers (others None), strings cut, lists and objects capped, depth limited."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return cut(value, STRING_CHARS)
    if depth >= DEPTH:
        return None
    if isinstance(value, list):
        return [plain(v, depth + 1) for v in value[:LIST_ITEMS]]
    if isinstance(value, dict):
        items = [(k, v) for k, v in value.items() if isinstance(k, str)][:MAX_KEYS]
        return {cut(k, 200): plain(v, depth + 1) for k, v in items}
    return None


def _numbers(d) -> dict:
    """Of a dict, its finite, non-negative numbers (a cache's positions and bytes)."""
    if not isinstance(d, dict):
        return {}
    return {k: v for k, v in d.items() if isinstance(k, str) and _finite(v) and v >= 0}


REUSE_COUNTS = ("reused", "computed", "invalidated", "first_invalidated_position", "stored_prefix",
                "copied_positions", "copied_bytes", "dropped_positions", "kept_positions")  # fmt: skip


def _reuse(r) -> dict | None:
    """A reuse report: a count that is not one, a word that is not a string, a copy time that is not a time
    are left out (their readers' defaults apply); a token named without an id and text is None."""
    if not isinstance(r, dict):
        return None
    out = plain(r)
    wrong = [k for k in REUSE_COUNTS if k in out and out[k] is not None and not _count(out[k])]
    wrong += [k for k in ("reason", "source", "overflow") if k in out and not isinstance(out[k], (str, type(None)))]
    if "copy_ms" in out and not (out["copy_ms"] is None or (_finite(out["copy_ms"]) and out["copy_ms"] >= 0)):
        wrong.append("copy_ms")
    for k in wrong:
        del out[k]
    for k in ("cached_token", "new_token"):
        if k not in out:
            continue
        t = out[k]
        ok = isinstance(t, dict) and _count(t.get("id")) and isinstance(t.get("text"), str)
        out[k] = {"id": t["id"], "text": cut(t["text"], TOKEN_CHARS)} if ok else None
    if "dropped_messages" in out:
        dropped = out["dropped_messages"]
        out["dropped_messages"] = [i for i in dropped if _count(i)] if isinstance(dropped, list) else []
    return out


MADE_COUNTS = ("capacity", "kv_bytes_per_position", "layers", "kv_heads", "head_dim", "bytes_per_value")


def _made_by(m) -> dict | None:
    """The engine and model facts a reply was stamped with: words as words, counts as counts, the cache's
    layer kinds as {kind, layers, window, slots} rows."""
    if not isinstance(m, dict):
        return None
    out = {}
    for k, v in m.items():
        if not isinstance(k, str) or k in ("kv_layer_kinds", "latent", "state"):
            continue
        if k in MADE_COUNTS:
            out[k] = v if _count(v) and (v > 0 or k != "layers") else None
        elif isinstance(v, str):
            out[k] = cut(v, STRING_CHARS)
        elif v is None or isinstance(v, bool) or _finite(v):
            out[k] = v
    kinds = m.get("kv_layer_kinds")
    if isinstance(kinds, list) and kinds:
        rows = [
            {"kind": d["kind"], "layers": d["layers"], "window": d.get("window"), "slots": d.get("slots")}
            for d in kinds[:8]
            if isinstance(d, dict)
            and isinstance(d.get("kind"), str)
            and _count(d.get("layers"))
            and all(d.get(x) is None or _count(d.get(x)) for x in ("window", "slots"))
        ]
        out["kv_layer_kinds"] = rows if len(rows) == len(kinds) else None
    for key, keys in (("latent", LATENT_COUNTS), ("state", STATE_COUNTS)):  # the panel's formula: counts, each
        given = m.get(key)
        if isinstance(given, dict) and given:
            extra = set(given) - set(keys)
            scans = key == "state" and extra == set(SCAN_STATE) and given.get("kind") in SCANNING
            ok = (not extra or scans) and all(_count(given.get(x)) for x in keys)
            ok = ok and (not scans or all(_count(given[x]) for x in SCAN_STATE if x != "kind"))
            out[key] = {x: given[x] for x in (*keys, *(SCAN_STATE if scans else ()))} if ok else None
    return out


STATE_COUNTS = ("layers", "hidden", "width", "bytes", "every", "snapshot_bytes_per_position")
SCAN_STATE = ("kind", "scan", "value_bytes")  # a scanning layer's besides: its kind, its scan's values, their bytes


LATENT_COUNTS = ("heads", "kv_lora_rank", "rope_dim", "nope_dim", "value_dim", "plain_bytes_per_position")


def _logprob(v) -> bool:
    return _finite(v) and v <= 0


def _step(s) -> dict | None:
    """One token's record, or None when a field is out of its range (a log-probability above 0, an entropy
    below it, a rank of 0)."""
    if not isinstance(s, dict) or not isinstance(s.get("shown"), str) or not isinstance(s.get("text"), str):
        return None
    token_id = s.get("token_id", -1)
    if not isinstance(token_id, int) or isinstance(token_id, bool) or not -1 <= token_id < 2**31:
        return None
    if not _logprob(s.get("logprob")):
        return None
    for k in ("sampled_logprob",):
        if s.get(k) is not None and not _logprob(s[k]):
            return None
    for k in ("entropy", "sampled_entropy"):
        if s.get(k) is not None and not (_finite(s[k]) and s[k] >= 0):
            return None
    if s.get("rank") is not None and not (_count(s["rank"]) and s["rank"] >= 1):
        return None
    top = s.get("top") or []
    if not isinstance(top, list):
        return None
    alts = []
    for a in top[:MAX_TOP]:
        if not isinstance(a, dict) or not isinstance(a.get("text"), str) or not _logprob(a.get("logprob")):
            return None
        alts.append({"text": cut(a["text"], TOKEN_CHARS), "logprob": float(a["logprob"])})
    return {
        "shown": cut(s["shown"], TOKEN_CHARS),
        "token_id": token_id,
        "text": cut(s["text"], TOKEN_CHARS),
        "logprob": float(s["logprob"]),
        "sampled_logprob": s.get("sampled_logprob"),
        "entropy": s.get("entropy"),
        "sampled_entropy": s.get("sampled_entropy"),
        "rank": s.get("rank"),
        "top": alts,
    }


TRACE_COUNTS = ("tokens", "prompt_tokens", "reused", "computed")


def _figures(t: dict) -> list[str]:
    """A trace's figures made numbers, in place: a time (`*_ms`, `*_s`) a finite number, a count a count, a
    list of times finite numbers; what was not is left out (its readers' defaults apply) and named."""
    bad = []
    for k, v in list(t.items()):
        if k in TRACE_COUNTS:
            ok = v is None or _count(v)
        elif k.endswith(("_ms", "_s")) and isinstance(v, list):
            ok = all(_finite(x) for x in v)
        elif k.endswith(("_ms", "_s")):
            ok = v is None or _finite(v)
        else:
            continue
        if not ok:
            del t[k]
            bad.append(k)
    return bad


ARGUMENT_CHARS = 64 * 1024  # a tool call's arguments, as the record keeps them


def _call(c) -> dict | None:
    """A tool call as a record keeps it: {id, name, arguments (JSON text)}; None where it is not one."""
    if not isinstance(c, dict) or not all(isinstance(c.get(k), str) for k in ("id", "name", "arguments")):
        return None
    return {"id": cut(c["id"], 200), "name": cut(c["name"], 200), "arguments": c["arguments"][:ARGUMENT_CHARS]}


def clean_record(record) -> dict | None:
    """A reply's record as the app may read it; `unreadable` names the fields left out because they were not
    what kvchat writes (the panel says so)."""
    if not isinstance(record, dict):
        return None
    # the token records are checked one by one below (_step), not copied here first
    out, bad = plain({k: v for k, v in record.items() if k != "tokens"}), []
    for k in ("status", "reason", "error"):
        if out.get(k) is not None and not isinstance(out[k], str):
            out[k], bad = None, [*bad, k]
    if out.get("on_screen_ms") is not None and not (_finite(out["on_screen_ms"]) and out["on_screen_ms"] >= 0):
        out["on_screen_ms"], bad = None, [*bad, "on_screen_ms"]
    if record.get("trace") is not None and not isinstance(record.get("trace"), dict):
        out["trace"], bad = None, [*bad, "trace"]
    elif isinstance(out.get("trace"), dict):
        bad += [f"trace.{k}" for k in _figures(out["trace"])]
        server = out["trace"].get("server")
        bad += [f"trace.server.{k}" for k in _figures(server)] if isinstance(server, dict) else []
    if record.get("made_by") is not None:
        out["made_by"] = _made_by(record["made_by"])
        bad += [] if out["made_by"] is not None else ["made_by"]
    if record.get("reuse") is not None:
        out["reuse"] = _reuse(record["reuse"])
        bad += [] if out["reuse"] is not None else ["reuse"]
    if record.get("cache") is not None:
        bad += [] if isinstance(record["cache"], dict) else ["cache"]
        out["cache"] = _numbers(record["cache"])
    tokens = record.get("tokens")
    if tokens is not None:
        steps = [_step(s) for s in tokens[:MAX_TOKENS]] if isinstance(tokens, list) else [None]
        if any(s is None for s in steps):  # one it cannot read: none is shown as a probability
            out["tokens"], out["tokens_reported"], bad = [], False, [*bad, "tokens"]
        else:
            out["tokens"] = steps
    if out.get("tokens_reported") is not None and not isinstance(out["tokens_reported"], bool):
        out["tokens_reported"] = None
    for key, many in (("tool_calls", True), ("tool_call", False)):  # a reply's calls; a result's call
        if record.get(key) is not None:
            value = record[key]
            calls = [_call(c) for c in value[:MAX_CALLS]] if many and isinstance(value, list) else [_call(value)]
            ok = not many or isinstance(value, list)
            out[key] = (calls if many else calls[0]) if ok and None not in calls else None
            bad += [] if out[key] is not None else [key]
    if record.get("images") is not None:  # a user message's images (desktop.core.image_files)
        out["images"] = checked_references(record["images"])
        bad += [] if out["images"] is not None else ["images"]
    if "left_out" in out:
        left = out["left_out"]
        out["left_out"] = [i for i in left if _count(i)] if isinstance(left, list) else []
    if bad:
        out["unreadable"] = bad
    return out


def read_record(text: str) -> dict | None:
    """A message's stored record, read as data: one that does not parse is unreadable."""
    try:
        return clean_record(json.loads(text))
    except (ValueError, RecursionError):
        return {"unreadable": ["record"]}


class CheckedRecords:
    """The records a store read last, by message id, with the text each was read from: a record is checked once
    while its text stays the same (the leaf is read for each button and each redraw of the panel, and checking
    65,536 token records takes a third of a second). Thread-safe: the store's reader thread reads too, and
    `readers` counts those reading now."""

    def __init__(self, kept: int = RECORDS_KEPT):
        self.kept, self.readers = kept, 0
        self._by_id: dict[int, tuple[str, dict | None]] = {}
        self._lock = threading.Lock()

    def held(self, mid: int, text: str) -> bool:
        with self._lock:
            hit = self._by_id.get(mid)
        return hit is not None and hit[0] == text

    def read(self, mid: int, text: str | None) -> dict | None:
        """The record of message `mid` stored as `text`, checked (or as checked before)."""
        if not text:
            return None
        with self._lock:
            hit = self._by_id.get(mid)
        if hit is not None and hit[0] == text:
            return hit[1]
        record = read_record(text)
        with self._lock:
            self._by_id.pop(mid, None)
            self._by_id[mid] = (text, record)
            while len(self._by_id) > self.kept:
                del self._by_id[next(iter(self._by_id))]
        return record

    def reading(self, change: int) -> None:
        with self._lock:
            self.readers += change
