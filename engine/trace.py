"""Request timing on one monotonic clock, and the figures derived from it.

TTFT = t1 - arrival (queue, templating, tokenizing and prefill all inside it), split into its
parts; TPOT = (tn - t1) / (n - 1), missing (None) below two tokens; tokens/s after the first =
1000 / TPOT[ms]; the whole-request mean (duration / n) is a separate, separately named figure.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

now = time.perf_counter  # the one clock: callers (the GUI's Send button) take arrival from it too


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 6)


# Each figure is computed here and only here: the finished trace, the live panel and the CLI call these.
def ttft_ms(arrival: float | None, token_times: list[float]) -> float | None:
    """t1 - arrival; missing before token 1."""
    return _ms(token_times[0] - arrival) if token_times and arrival is not None else None


def tpot_ms(token_times: list[float]) -> float | None:
    """(tn - t1) / (n - 1); missing (None, never 0) below two tokens."""
    n = len(token_times)
    return None if n < 2 else _ms((token_times[-1] - token_times[0]) / (n - 1))


def decode_tok_s(tpot: float | None) -> float | None:
    """Tokens per second after the first: 1000 / TPOT[ms]."""
    return None if not tpot else round(1000.0 / tpot, 6)


def e2e_ms(arrival: float | None, token_times: list[float], end: float | None = None) -> float | None:
    """From arrival to the last token (or to the end of a request that produced none)."""
    last = token_times[-1] if token_times else end
    return _ms(last - arrival) if last is not None and arrival is not None else None


def gaps_ms(token_times: list[float]) -> list[float]:
    """The gaps between consecutive tokens."""
    return [_ms(b - a) for a, b in zip(token_times, token_times[1:])]


@dataclasses.dataclass
class RequestTrace:
    arrival: float  # when the person asked (Send pressed), seconds on `now`
    started: float | None = None  # the engine picked the request up
    tokenized: float | None = None  # template rendered and tokenized
    prefill_start: float | None = None
    prefill_end: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # emission time of each output token
    end: float | None = None
    status: str = "running"  # running | finished | failed | cancelled
    prompt_tokens: int = 0
    reused: int = 0  # prompt positions whose K/V came from the cache
    computed: int = 0  # prompt positions the prefill computed
    error: str | None = None
    batch_sizes: list[int] = dataclasses.field(default_factory=list)  # sequences in each of its decode steps
    prefill_chunks: int = 0  # the forwards its prefill took (other requests' steps ran between them)
    lane: int | None = None  # which of the engine's lanes ran it (engine.batching)
    policy: str | None = None  # the scheduler's policy it ran under (engine.batching.POLICY)
    speculative: object = None  # its drafting's counts (engine.speculative.SpecStats), with drafts
    grammar: dict | None = None  # what its grammar did (engine.grammar.Guide.summary), with one
    draft_load_ms: float | None = None  # the draft model's load, inside its TTFT (its first speculative request)
    pool_wait_ms: float | None = None  # of its queue wait, the time it waited for the KV pool's room
    kv_blocks_promised: int | None = None  # the pool's blocks it was admitted with (prompt and reply at most)
    images: dict | None = None  # its prompt's images: how many, their positions, how many encoded, the encoder's ms
    vision_ms: float | None = None  # the vision encoder's time inside its prefill (a part of TTFT of its own)

    @classmethod
    def of(cls, request) -> RequestTrace:
        """A request's trace from its arrival (when Send was pressed; now when it does not say)."""
        return cls(arrival=request.arrival if request.arrival is not None else now())

    # --- derived -------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft_ms(self) -> float | None:
        return ttft_ms(self.arrival, self.token_times)

    @property
    def ttft_parts_ms(self) -> dict[str, float | None]:
        """queue + template/tokenize (+ the images' encoder) + prefill + first token = TTFT."""

        def gap(a, b):
            return _ms(b - a) if a is not None and b is not None else None

        t1 = self.token_times[0] if self.token_times else None
        prefill = gap(self.tokenized, self.prefill_end)
        vision = self.vision_ms
        return {
            "ttft_queue_ms": gap(self.arrival, self.started),
            "ttft_tokenize_ms": gap(self.started, self.tokenized),
            **({"ttft_vision_ms": vision} if vision is not None else {}),  # the images' encoder, with images
            "ttft_prefill_ms": prefill if prefill is None or vision is None else round(prefill - vision, 6),
            "ttft_first_token_ms": gap(self.prefill_end, t1),
        }

    @property
    def gaps_ms(self) -> list[float]:
        return gaps_ms(self.token_times)

    @property
    def tpot_ms(self) -> float | None:
        return tpot_ms(self.token_times)

    @property
    def decode_tok_s(self) -> float | None:
        return decode_tok_s(self.tpot_ms)

    @property
    def e2e_ms(self) -> float | None:
        return e2e_ms(self.arrival, self.token_times, self.end)

    @property
    def mean_ms_per_token_incl_wait(self) -> float | None:
        """Request duration / n: includes the first-token wait, so it is not TPOT."""
        e2e = self.e2e_ms
        return None if e2e is None or not self.tokens else round(e2e / self.tokens, 6)

    @property
    def prefill_ms(self) -> float | None:
        if self.prefill_start is None or self.prefill_end is None:
            return None
        return _ms(self.prefill_end - self.prefill_start)

    @property
    def prefill_tok_s(self) -> float | None:
        """Positions actually computed per second; reused positions are not counted."""
        ms = self.prefill_ms
        return None if not ms or not self.computed else round(self.computed / (ms / 1000.0), 3)

    def summary(self) -> dict:
        return {
            "status": self.status,
            "ttft_ms": self.ttft_ms,
            **self.ttft_parts_ms,
            "tpot_ms": self.tpot_ms,
            "tokens": self.tokens,
            "decode_tok_s": self.decode_tok_s,
            "prefill_ms": self.prefill_ms,
            "prefill_tok_s": self.prefill_tok_s,
            "e2e_ms": self.e2e_ms,
            "mean_ms_per_token_incl_wait": self.mean_ms_per_token_incl_wait,
            "prompt_tokens": self.prompt_tokens,
            "reused": self.reused,
            "computed": self.computed,
            "gaps_ms": self.gaps_ms,
            "error": self.error,
            "batch_sizes": list(self.batch_sizes),
            "prefill_chunks": self.prefill_chunks,
            "lane": self.lane,
            "policy": self.policy,
            "pool_wait_ms": self.pool_wait_ms,
            "kv_blocks_promised": self.kv_blocks_promised,
            "draft_load_ms": self.draft_load_ms,
            "grammar": self.grammar,
            "images": self.images,
            "speculative": None if self.speculative is None else self.speculative.to_dict(*self._decode_span()),
        }

    def _decode_span(self) -> tuple[int, float | None]:
        """Tokens after the first, and the seconds they took (what drafting speeds up)."""
        times = self.token_times
        return len(times) - 1, (times[-1] - times[0]) if len(times) > 1 else None


def summarize(traces: list[RequestTrace]) -> dict:
    """Over a session: every request counted, failed and cancelled ones included, never dropped."""
    ttfts = [t.ttft_ms for t in traces if t.ttft_ms is not None]
    tpots = [t.tpot_ms for t in traces if t.tpot_ms is not None]
    return {
        "requests": len(traces),
        "finished": sum(t.status == "finished" for t in traces),
        "failed": sum(t.status == "failed" for t in traces),
        "cancelled": sum(t.status == "cancelled" for t in traces),
        "median_ttft_ms": statistics.median(ttfts) if ttfts else None,
        "median_tpot_ms": statistics.median(tpots) if tpots else None,
    }
