"""The panel's figures in words, Qt-free: times, rates, sizes and bytes as the panel writes them, where reused
positions came from, what an overflow policy left out, the disk tier's state, a server's own timings."""

from __future__ import annotations

from engine.request import OVERFLOW_POLICIES
from engine.speculative import nothing_drafted
from engine.state_cache import kind_layers

DASH = "—"
NOT_REPORTED = "not reported by this server"


def messages(n: int) -> str:
    return f"{n:,} message" + ("" if n == 1 else "s")


def fmt_ms(v) -> str:
    return DASH if v is None else f"{v:,.1f} ms"


def fmt_figure(v: float, digits: int = 3) -> str:
    """A figure to `digits` places that never reads "-0.000" (a mean log-probability or entropy that rounds
    to zero from below)."""
    text = f"{v:.{digits}f}"
    return text.lstrip("-") if float(text) == 0 else text


def image_words(images, per_position) -> str:
    """A request's images in a line: "2 images · 512 positions (6.0 MiB of K/V) · encoder 830.1 ms for 2"."""

    def count(key):  # a record is data from outside: a count that is not one reads as 0
        v = images.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

    if not isinstance(images, dict) or not count("images"):
        return "none"
    n, positions, encoded = count("images"), count("positions"), count("encoded")
    kv = f" ({fmt_size(positions * per_position)} of K/V)" if isinstance(per_position, int) else ""
    ms = images.get("encoder_ms")
    work = f"encoder {ms:,.1f} ms for {encoded}" if encoded and isinstance(ms, (int, float)) else "none encoded"
    return f"{n} image{'s' if n != 1 else ''} · {positions:,} positions{kv} · {work}"


def ttft_parts(parts: dict, stopped_early: bool) -> str:
    """TTFT's parts, each named ("queue 21.8 · template 0.4 · prefill 31.4 · 1st token 0.8 ms"); for a request
    that failed or was stopped first, the parts it never reached are said so, not shown as dashes."""
    missing = [k for k, v in parts.items() if v is None]
    if not (stopped_early and missing):
        return " · ".join(f"{k} {DASH if v is None else f'{v:,.1f}'}" for k, v in parts.items()) + " ms"
    known = " · ".join(f"{k} {v:,.1f}" for k, v in parts.items() if v is not None)
    return (f"{known} ms · " if known else "") + "not reached: " + ", ".join(missing)


def fmt_rate(v, unit="tok/s") -> str:
    return DASH if v is None else f"{v:,.1f} {unit}"


def fmt_size(n) -> str:
    """A short size: 88.2 MiB."""
    if n is None:
        return DASH
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,} B"


def fmt_bytes(n) -> str:
    """The exact count and the short size: 92,471,296 B (88.2 MiB)."""
    short = fmt_size(n)
    return short if n is None or n < 2**10 else f"{n:,} B ({short})"


def percentile(values, q):
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def reuse_source(r: dict) -> str:
    """Where a request's reused positions came from, with the copy's cost when the store gave them."""
    source = r.get("source", "none")
    if source in ("store", "disk"):
        what = "prefix store · {:,} positions copied" if source == "store" else "disk tier · {:,} positions read"
        return (
            what.format(r.get("copied_positions", 0))
            + f" ({fmt_size(r.get('copied_bytes'))} in {r.get('copy_ms') or 0:,.1f} ms)"
        )
    return {
        "working": "working cache",
        "none": "nothing (all computed)",
        "server": "the server's cache (as it reports it)",
        "unknown": NOT_REPORTED,
    }.get(source, source)


def dropped_words(r: dict) -> str:
    """What a request's overflow policy left out, in words ("nothing" when the conversation fit)."""
    n, which = r.get("dropped_positions") or 0, r.get("dropped_messages") or ()
    if not n:
        return "nothing (it fit)" if r.get("source") not in ("unknown", "server") else NOT_REPORTED
    what = messages(len(which)) if which else "tokens"
    return f"{what}, {n:,} positions ({OVERFLOW_POLICIES.get(r.get('overflow'), r.get('overflow'))})"


def disk_words(disk: dict | None) -> str:
    """The disk tier in a line: bytes against its budget, blocks of this model (and of all), the read rate."""
    if not disk:
        return "off"
    if not disk["budget"]:
        return "off (budget 0)"
    text = (
        f"{fmt_size(disk['bytes'])} of {fmt_size(disk['budget'])} · {disk['blocks_this_model']:,} blocks of this model"
    )
    if disk["blocks"] != disk["blocks_this_model"]:
        text += f" ({disk['blocks']:,} in all)"
    if disk.get("queued_blocks"):
        text += f", {disk['queued_blocks']:,} being written"
    if disk.get("read_rate"):
        text += f" · read at {fmt_size(disk['read_rate'])}/s"
    if disk.get("refused"):
        text += f" · {disk['refused'][-1]}"
    return text


def server_timing(trace: dict | None) -> str:
    """What the server says its own timings were: kvchat's trace, or llama.cpp's `timings`."""
    server = (trace or {}).get("server")
    if not server:
        return NOT_REPORTED
    t = server.get("llama.cpp timings")
    if t is not None:
        return (
            f"prompt {t.get('prompt_n', '?')} positions in {t.get('prompt_ms', 0):,.1f} ms "
            f"(cached {t.get('cache_n', '?')}) · {t.get('predicted_n', '?')} tokens in "
            f"{t.get('predicted_ms', 0):,.1f} ms"
        )
    return (
        f"TTFT {fmt_ms(server.get('ttft_ms'))} · TPOT {fmt_ms(server.get('tpot_ms'))} · "
        f"{fmt_rate(server.get('decode_tok_s'))} · prefill {fmt_ms(server.get('ttft_prefill_ms'))}"
    )


def cached_words(seen: dict | None) -> str:
    """How much of a conversation is cached (the worker's probe), and for one on disk what a return costs."""
    if not seen:
        return DASH
    if "error" in seen:
        return seen["error"]
    where = {"working": "working cache", "store": "prefix store", "none": "nothing cached", "disk": "on disk"}
    text = f"{seen['cached']:,} of {seen['positions']:,} positions ({where[seen['source']]})"
    if seen["source"] == "disk":  # what a return costs, both measured on this machine
        read, prefill = seen.get("disk_read_ms"), seen.get("prefill_ms")
        text += f": ≈ {fmt_ms(read)} to read" if read is not None else ": read time not measured yet"
        text += f" against ≈ {fmt_ms(prefill)} to prefill" if prefill is not None else ""
    return text


ORDINALS = ("1st", "2nd", "3rd")
INT4_MEANING = "the share of next tokens on which the 4-bit weights agree with the full ones"


def draft_rows(spec: dict | None, steps: list[dict], asked: str = "") -> dict[str, str]:
    """The Speculative decoding rows of one reply: its finished trace's counts (`spec`: engine.speculative's, or a
    server's), or, while it streams, what its tokens say so far (`steps`' parts in the drafts); `asked`: the
    draft the settings name (for a reply made without one)."""
    kinds = [s.get("draft") for s in steps if isinstance(s, dict) and s.get("draft")]
    if not spec and not kinds:
        none = f"none for this reply (the settings now: {asked})" if asked else "none (Settings → Speculative decoding)"
        return {"draftValue": none, **dict.fromkeys(("acceptedValue", "byPositionValue", "draftCostValue",
                                                     "speedupValue"), DASH)}  # fmt: skip
    if not spec:  # streaming: the tokens so far
        took = kinds.count("accepted")
        return {"draftValue": "drafting…", "acceptedValue": f"{took:,} of {len(kinds):,} tokens so far from drafts",
                "byPositionValue": DASH, "draftCostValue": DASH, "speedupValue": DASH}  # fmt: skip
    label = str(spec.get("label") or spec.get("draft") or "?")
    k = spec.get("k")
    out = {"draftValue": label + (f" · up to {k} a round" if isinstance(k, int) else "")}
    n, ok, rate = spec.get("drafted"), spec.get("accepted"), spec.get("acceptance")
    if not n:  # no round drafted (drafting stops for a while only after rounds that did not pay)
        return {**out, "acceptedValue": f"nothing drafted: {nothing_drafted(spec)}", "byPositionValue": DASH,
                "draftCostValue": DASH, "speedupValue": f"{DASH} (the model ran alone)"}  # fmt: skip
    rounds = spec.get("rounds")
    accepted = f"{ok:,} of {n:,} drafted ({rate:.0%})" + (f" in {rounds:,} rounds" if rounds else "")
    if spec.get("draft") == "int4":
        accepted += f": {INT4_MEANING}"
    out["acceptedValue"] = accepted
    by = spec.get("acceptance_by_position") or []
    out["byPositionValue"] = (
        " · ".join(
            f"{ORDINALS[i] if i < 3 else f'{i + 1}th'} {DASH if r is None else f'{r:.0%}'}" for i, r in enumerate(by)
        )
        or NOT_REPORTED
    )
    d, v = spec.get("draft_ms"), spec.get("verify_ms")
    out["draftCostValue"] = NOT_REPORTED if d is None or v is None else f"drafting {fmt_ms(d)} · verifying {fmt_ms(v)}"
    speed, step, per = spec.get("speedup"), spec.get("target_step_ms"), spec.get("ms_per_token")
    out["speedupValue"] = (
        NOT_REPORTED
        if speed is None
        else f"{speed:.2f}× the model alone: {fmt_ms(per)} a token against {fmt_ms(step)} a step, both measured "
        "in this reply"
    )
    return out


MODEL_ROWS = [("modelNameValue", "Model"), ("architectureValue", "Architecture"), ("parametersValue", "Parameters"),
              ("dtypeValue", "dtype"), ("precisionValue", "Weights · KV cache"), ("weightBytesValue", "Weight bytes"),
              ("fileTensorsValue", "From the file"), ("deviceValue", "Device"), ("kernelsValue", "Decode kernels"),
              ("layersValue", "Layers"), ("kvHeadsValue", "KV heads · query heads"),
              ("headDimValue", "Head width")]  # fmt: skip
SESSION_ROWS = [("requestsValue", "Requests"), ("failedValue", "Failed · cancelled"),
                ("medianTtftValue", "Median TTFT"), ("medianTpotValue", "Median TPOT")]  # fmt: skip
DRAFT_ROWS = [("draftValue", "Draft"), ("acceptedValue", "Accepted"), ("byPositionValue", "By draft position"),
              ("draftCostValue", "Drafting · verifying"), ("speedupValue", "Against the model alone")]  # fmt: skip
GRAMMAR_ROWS = [("grammarValue", "Grammar"), ("removedValue", "Probability removed"),
                ("overriddenValue", "Model overridden"), ("maskTimeValue", "Mask time")]  # fmt: skip


def grammar_rows(g: dict | None, steps: list[dict], asked: str = "") -> dict[str, str]:
    """The Structured output rows of one reply: its finished trace's summary (`g`: engine.grammar's), or, while it
    streams, what its tokens' figures say so far; `asked`: the format the conversation has now (for a reply made
    without one)."""
    marks = [s["grammar"] for s in steps if isinstance(s, dict) and isinstance(s.get("grammar"), dict)]
    if not g and not marks:
        none = f"none for this reply (the conversation's now: {asked})" if asked else "none (Settings → Reply format)"
        return {"grammarValue": none, **dict.fromkeys(("removedValue", "overriddenValue", "maskTimeValue"), DASH)}
    if not g:  # streaming: the tokens so far
        removed = [m["removed"] for m in marks if isinstance(m.get("removed"), (int, float))]
        overridden = sum(isinstance(m.get("preferred"), int) for m in marks)
        mean = f"{sum(removed) / len(removed):.0%} a step so far" if removed else DASH
        return {"grammarValue": "constraining…", "removedValue": mean,
                "overriddenValue": f"{overridden:,} of {len(marks):,} steps so far", "maskTimeValue": DASH}  # fmt: skip
    n, mean, overridden = g.get("steps") or 0, g.get("mean_removed"), g.get("overridden") or 0
    mask, wait = g.get("mask_us"), g.get("wait_us")
    return {
        "grammarValue": str(g.get("grammar") or g.get("kind") or "?"),
        "removedValue": DASH if mean is None else f"{mean:.1%} of the model's probability a step (mean)",
        "overriddenValue": f"{overridden:,} of {n:,} steps: the model's first choice forbidden",
        "maskTimeValue": NOT_REPORTED if mask is None else f"{mask:,.0f} µs a token · {wait or 0:,.0f} µs waited for",
    }


def latent_formula(f: dict, positions: int, payload: int) -> str:
    """Multi-head latent attention's cache formula with the reply's figures: one latent (d_c) and one rotated key
    (d_r) a position per layer, codes plus a float32 scale for each of the cache's two halves when quantized; then
    the bytes plain attention over the same heads would hold, 2 · L · T · H · (d_k + d_v) / 2."""
    m, kv = f["latent"], f.get("kv_cache", "none")
    dc, dr, layers = m["kv_lora_rank"], m["rope_dim"], f["layers"]
    if kv == "none":
        width = f"({dc} + {dr}) · {f['bytes_per_value']}"
    else:
        width = f"(({dc} + {dr})·{8 if kv == 'int8' else 4}/8 + 2·4)"
    plain = m["plain_bytes_per_position"] * positions
    dk, b = m["nope_dim"] + dr, f["bytes_per_value"]
    ratio = f", {plain / payload:.1f}× the latent's" if payload else ""
    codes = "" if kv == "none" else f" ({kv} + scales)"
    return (
        f"{layers} · {positions} · {width} = {payload:,} B{codes} · plain attention would hold "
        f"{layers} · {positions} · {m['heads']} · ({dk} + {m['value_dim']}) · {b} = {plain:,} B{ratio}"
    )


def kv_formula(f: dict, held: list[tuple[int, int]], kinds: list[dict] | None, positions: int, payload: int) -> str:
    """The payload's formula with the reply's figures: 2 · L · T · H_kv · d · b for each kind of layer (`held`: its
    layers and the positions they hold, a sliding layer's min(T, W)), codes plus their scales for a quantized
    cache, `f` the facts of the model that made it. Latent attention's: L · T · (d_c + d_r) · b, beside what plain
    attention over the same heads would take."""
    if f.get("latent"):
        return latent_formula(f, positions, payload)
    width = (  # bytes per (position, head): values, or codes plus one float32 scale (int8/int4 K/V)
        f"{f['head_dim']} · {f['bytes_per_value']}"
        if f.get("kv_cache", "none") == "none"
        else f"({f['head_dim']}·{8 if f['kv_cache'] == 'int8' else 4}/8 + 4)"
    )
    terms = []
    for (layers, t), kind in zip(held, kinds or [None]):
        slid = kind is not None and kind["kind"] == "sliding"
        t_text = f"min({positions}, {kind['window']:,})" if slid else str(t)
        terms.append(f"2 · {layers} · {t_text} · {f['kv_heads']} · {width}")
    state = f.get("state")
    if state and state.get("scan"):  # scanning layers: L_m · (C_m · (K_m − 1) + scan values) · 4, whatever T
        terms.append(f"{state['layers']} · ({state['hidden']} · {state['width']} + {state['scan']}) · "
                     f"{state.get('value_bytes', 4)} (state)")  # fmt: skip
    elif state:  # a hybrid's convolution layers: L_conv · D · (K − 1) · b, whatever T
        terms.append(f"{state['layers']} · {state['hidden']} · {state['width']} · {f['bytes_per_value']} (state)")
    codes = "" if f.get("kv_cache", "none") == "none" else f" ({f['kv_cache']} + scales)"
    return " + ".join(terms) + f" = {payload:,} B{codes}"


def formula_title(f: dict) -> str:
    """The KV formula row's title for a model's facts: plain attention's, latent attention's or a hybrid's."""
    if f.get("latent"):
        return "L·T·(d_c+d_r)·b"
    return "2·L·T·H_kv·d·b + state" if f.get("state") else "2·L·T·H_kv·d·b"


def state_layers(state: dict) -> str:
    """A hybrid's state layers in words: its Mamba-2 layers (Granite 4.0-H), its gated DeltaNet layers (Qwen3-Next)
    or its convolution layers (LFM2)."""
    return kind_layers(state.get("kind", "conv"))


def state_words(state: dict | None, positions: int) -> str:
    """A hybrid's state row: its convolution layers' state (the same at any length) and the snapshots kept of it so
    far; a dash for a model whose every layer keeps K/V."""
    if not state:
        return DASH
    kept = positions // state["every"]
    snaps = kept * state["every"] * state["snapshot_bytes_per_position"]
    return (f"{state['layers']} {state_layers(state)}: {fmt_bytes(state['bytes'])}, the same at any length · "
            f"{kept:,} snapshots (one every {state['every']} positions): {fmt_bytes(snaps)}")  # fmt: skip
