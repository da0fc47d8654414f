"""Generation as named steps, as gpt-fast and nanochat name theirs: `prefill` (the prompt's uncached positions,
a chunk a forward), `Decoder.step` (consume one token, through a CUDA graph where one works) and `decode`
(select token k from the last logits, stream it, stop or consume it for k+1). `decode` does not run its own
steps: it yields a `StepWanted` and is sent the logits, so that one scheduler can run the steps of many
sequences together (engine.batching); `alone` answers them one by one for a generation on its own."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from . import passes
from . import trace as tracing
from .backends.cuda_graph import GraphDecoder, graphs_wanted
from .events import WAITING, Token
from .kv_cache import make_cache
from .logprobs import step_logprobs
from .model import FEW_POSITIONS
from .rotary import rope_offset
from .sampling import draw

# Why 256 positions: engine/BENCHMARKS.md, "Decisions, and what was measured for them".
PREFILL_CHUNK = 256  # float32 positions per prefill step: progress and Stop act between steps


def prefill_chunk_for(dtype: torch.dtype) -> int:
    """Positions per prefill step: the activation bytes of PREFILL_CHUNK float32 positions, so a 16-bit
    model takes steps of 512 (its GEMMs run further below their speed on fewer rows)."""
    return PREFILL_CHUNK * 4 // dtype.itemsize


class RowsWanted:
    """What `prefill` yields, while other sequences decode, to have a few prompt positions computed as rows of the
    scheduler's next batched step beside their decode rows (Transformer.forward_spans: the weights read once for
    all); it is sent the logits after the last ([1, 1, V])."""

    __slots__ = ("model", "cache", "tokens")

    def __init__(self, model, cache, tokens: list[int]):
        self.model, self.cache, self.tokens = model, cache, tokens

    eager = True  # no captured graph: any batched step of its model may take it

    @property
    def span(self) -> tuple[list[int], object]:
        return self.tokens, self.cache

    def alone(self) -> torch.Tensor:
        """The positions in a forward of their own (no batched step took them)."""
        ids = torch.tensor([self.tokens], device=self.model.norm.weight.device)  # [1, T]
        return self.model(ids, self.cache, last_only=True)  # [1, 1, V]


def prefill(
    model, cache, ids: list[int], tokens: list[int], chunk, device, images=None, rows=None
) -> Iterator[tuple[int, torch.Tensor] | RowsWanted]:
    """Consume `tokens` after the cache's positions, `chunk` of them a forward (a count, or a function asked
    before each forward: the scheduler's budget for the turn): after each, (how many are consumed, the logits of
    the last [1, 1, V]); `ids` gains each chunk as the cache does. `images`: the prompt's images
    (engine.image_prompt.PromptImages), whose positions take the encoder's rows: its layers each yield (done, None).
    `rows`: asked before each forward while other sequences decode (the scheduler's), how many positions to ride
    as rows of their batched step instead (a RowsWanted yielded, sent the logits); None, or 0: a forward here."""
    done = 0
    cache.rope_offset = images.rope_offset if images is not None else 0  # what later positions' rotations add
    while done < len(tokens):
        k = rows() if rows is not None and images is None else None
        if k and model.rows_ready(cache):
            piece = tokens[done : done + min(k, FEW_POSITIONS)]
            logits = yield RowsWanted(model, cache, piece)
            ids.extend(piece)
            done += len(piece)
            yield done, logits
            continue
        n = max(1, chunk() if callable(chunk) else chunk)
        if images is not None:
            n = images.piece(tokens, done, n, getattr(cache, "max_chunk", None))
        piece = tokens[done : done + n]
        for _ in images.encode(piece) if images is not None else ():  # an image's encoder, a layer a time:
            yield done, None  # the others' turn (and a Stop) between its layers, no position computed
        rows = images.rows(piece, len(ids)) if images is not None else None  # len(ids): where the piece starts
        x = torch.tensor([[max(t, 0) for t in piece] if rows is not None else piece], device=device)  # [1, T]
        logits = model(x, cache, last_only=True, images=rows)  # [1, T, V] -> [1, 1, V]
        ids.extend(piece)
        done += len(piece)
        yield done, logits


WARM_POSITIONS = 24  # the warm-up's prompt: a prefill forward of this many positions, then two decode steps


@torch.inference_mode()
def warm_up(loaded, kv: str) -> float:
    """A short prefill and two decode steps on a scratch cache of the model just loaded, and its chat template
    rendered once, so that the first request does not pay what a first forward costs (the weights' pages read
    in, the kernels' threads started, torch's first dispatch of each op). Nothing a request sees is touched: not
    the working cache, the prefix store nor the traces. Returns how long it took, in ms."""
    start = tracing.now()
    loaded.tokenizer.chat_prompt([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    n = min(WARM_POSITIONS, loaded.config.max_position_embeddings - 2, loaded.config.vocab_size)
    scratch = make_cache(loaded.config, n + 2, loaded.dtype, loaded.device, kv, n)
    device = loaded.device
    loaded.model(torch.arange(n, device=device)[None], scratch, last_only=True)  # [1, n] -> [1, 1, V]
    for t in (1, 2):
        logits = loaded.model(torch.tensor([[t]], device=device), scratch, last_only=True)  # [1, 1] -> [1, 1, V]
    logits.float().sum().item()  # waits for the device
    return (tracing.now() - start) * 1000


class Decoder:
    """One decode step on one cache: consume a token ([1, 1]) and give the logits for the next ([1, 1, V]),
    through a captured CUDA graph where one works (`error` says why not), else the eager forward."""

    def __init__(self, loaded, cache):
        self.loaded, self.cache = loaded, cache
        self._graph: GraphDecoder | None = None
        self.error: str | None = None

    def step(self, token: int) -> torch.Tensor:
        loaded = self.loaded
        if rope_offset(self.cache):  # mrope after an image: a captured graph rotates by index, this step must not
            return loaded.model(torch.tensor([[token]], device=loaded.device), self.cache, last_only=True)
        if self._graph is not None:
            self.cache.reserve(self.cache.length, self.cache.length + 1)  # a pool's block, maybe a growth, first
            if self._graph.moved:  # the KV pool grew: captured again over its new buffers
                self._graph = None
        if self._graph is None and self.error is None and graphs_wanted(loaded.device, self.cache):
            try:
                self._graph = GraphDecoder(loaded.model, self.cache)
            except Exception as e:  # capture unsupported here: stay eager, keep the reason
                self.error = f"{type(e).__name__}: {e}"
        if self._graph is not None:
            try:
                return self._graph.step(token)
            except RuntimeError as e:
                self._graph, self.error = None, str(e)
        return loaded.model(torch.tensor([[token]], device=loaded.device), self.cache, last_only=True)

    @property
    def path(self) -> str:
        return "cuda-graph" if self._graph is not None else "eager"


class StepWanted:
    """What `decode` yields to have `token` consumed on `decoder`'s cache: it is sent the logits ([1, 1, V])."""

    __slots__ = ("decoder", "token")

    def __init__(self, decoder: Decoder, token: int):
        self.decoder, self.token = decoder, token

    @property
    def model(self):
        return self.decoder.loaded.model

    @property
    def eager(self) -> bool:  # a captured graph runs its own step: no batched step takes it
        return self.decoder.path == "eager"

    @property
    def span(self) -> tuple[list[int], object]:
        return [self.token], self.decoder.cache

    def alone(self) -> torch.Tensor:
        return self.decoder.step(self.token)


@torch.inference_mode()  # called by the scheduler's turn, outside the generators' own inference mode
def step_all(wanted: list[StepWanted | RowsWanted]) -> list[torch.Tensor]:
    """The decode steps of several sequences, one turn of the engine (and a prefilling sequence's few positions
    riding beside them, RowsWanted): the logits ([1, 1, V]) for each, in order. Sequences of one model whose
    backend takes them together run in one call (Transformer.forward_spans, kvchat's kernels: the weights read
    once for all, each row bit for bit its step alone); where there are no kernels (a GPU, a CPU that cannot
    build them) torch's products take the decode rows together (engine.passes.rows, each row its step alone up
    to the products' order of summation); the others one by one."""
    rides = any(isinstance(w, RowsWanted) for w in wanted)
    if len(wanted) > 1 or rides:
        model = wanted[0].model
        if all(w.model is model and w.eager for w in wanted):
            out = model.forward_spans([w.span for w in wanted])
            if out is not None:
                return out
        loaded = wanted[0].decoder.loaded if not rides else None  # torch's rows take decode steps only
        if loaded is not None and all(w.decoder.loaded is loaded for w in wanted) and rows_together(loaded):
            tokens, caches = [w.token for w in wanted], [w.decoder.cache for w in wanted]
            logits = passes.rows(loaded.model, tokens, caches)  # [B, 1, V]
            return [logits[b : b + 1] for b in range(len(wanted))]
    return [w.alone() for w in wanted]


def rows_together(loaded) -> bool:
    """Whether torch's products take several sequences' steps at once: where kvchat's kernels do not run decode (a
    GPU; a CPU without them). Where they do, a step they cannot batch (a quantized KV cache) runs alone, exact."""
    return loaded.device.type != "cpu" or loaded.kernels is None


def alone(steps: Iterator) -> Iterator:
    """A generation's events with its decode steps run as they are asked for (a batch of one)."""
    answer = None
    try:
        while True:
            try:
                item = steps.send(answer)
            except StopIteration:
                return
            if isinstance(item, (StepWanted, RowsWanted)):  # (rows are asked of a scheduler only: here, alone)
                answer = item.alone()
            elif item is WAITING:  # a speculative round's end: nothing else runs beside it here
                answer = None
            else:
                answer = None
                yield item
    finally:
        steps.close()


class Reply:
    """The tokens of one reply as they are chosen: each drawn from a step's logits under the request's sampling (its
    own seeded generator), told as a Token event, and checked against the request's stops — a stop token, a stop
    string, its token limit, Stop, the cache's capacity (`reason` says which). The decode loop and the speculative
    one both choose their tokens through it."""

    def __init__(self, req, tok, stream, trace, cache, cancel: threading.Event, guide=None):
        self.req, self.tok, self.stream, self.trace, self.cache, self.cancel = req, tok, stream, trace, cache, cancel
        self.guide = guide  # the request's grammar (engine.grammar.Guide): each token drawn among those it allows
        self.masks: list = []  # each token's MaskStep, with a grammar
        self.generator = None
        if not req.sampling.greedy:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(req.sampling.seed if req.sampling.seed is not None else torch.seed())
        self.penalty = req.sampling.repetition_penalty != 1.0
        self.out: list[int] = []
        self.steps = []  # each token's StepLogprobs, when asked for
        self.drafts: list[str] = []  # each token's part in speculative decoding ("" without)
        self.reason = "max_new_tokens"

    def row(self, logits: torch.Tensor) -> torch.Tensor:
        """A step's logits [V] where the sampler reads them (the host, for a generator or a penalty)."""
        return logits.float().cpu() if self.generator is not None or self.penalty else logits

    def seen(self, ids: list[int], row: torch.Tensor) -> torch.Tensor | None:
        """The ids a repetition penalty weighs (None without one)."""
        return torch.tensor(ids, dtype=torch.long, device=row.device) if self.penalty else None

    def choose(self, row: torch.Tensor, ids: list[int]) -> tuple[int, torch.Tensor]:
        """The next token from a step's logits `row` [V] after `ids`, and the logits it was drawn from (with a
        grammar: those it forbids at -inf; what it did kept for the token's event)."""
        if self.guide is None:
            return draw(row, self.req.sampling, self.generator, self.seen(ids, row))
        allowed = self.guide.allowed(row.device)  # bool [V], ids [n]
        self._mask = self.guide.weigh(row, allowed)
        return draw(self.guide.restrict(row, allowed), self.req.sampling, self.generator, self.seen(ids, row))

    def emit(self, token: int, row: torch.Tensor, drawn: torch.Tensor, positions: int, draft: str = "",
             rejected: int = 0) -> Token | None:  # fmt: skip
        """The Token event for `token` (chosen from `row`, drawn from `drawn`; `positions` consumed when it was
        chosen; `draft` and `rejected` as Token has them), or None where it is a stop token: the reply ends there
        (reason eos)."""
        req = self.req
        if token in self.tok.stop_ids and (not req.ignore_eos or self.guide is not None):
            self.reason = "eos"
            return None
        mask = None
        if self.guide is not None:
            self.guide.consume(token)
            mask = self._mask
            self.masks.append(mask)
        weighed = None
        if req.logprobs:
            greedy = req.sampling.greedy
            weighed = step_logprobs(
                row, drawn, token, req.top_logprobs, greedy, self.tok.token_text, greedy and not self.penalty
            )
            self.steps.append(weighed)
        t = tracing.now()
        self.trace.token_times.append(t)
        self.out.append(token)
        self.drafts.append(draft)
        return Token(len(self.out), token, self.stream.push(token), t, positions, weighed, draft, rejected, mask)

    def done(self, positions: int) -> bool:
        """Whether the reply stops after its last token (`reason` says why), `positions` consumed then."""
        req = self.req
        if req.stop_strings and any(s in self.stream.new_text for s in req.stop_strings):
            self.reason = "stop_string"
        elif len(self.out) == req.max_new_tokens:
            self.reason = "max_new_tokens"
        elif self.cancel.is_set():
            self.reason = "cancelled"
        elif positions >= self.cache.capacity:
            self.reason = "capacity"
        elif self.guide is not None and self.guide.done:
            self.reason = "grammar"
        else:
            return False
        return True


def decode(req, logits: torch.Tensor, decoder: Decoder, ids: list[int], tok, stream, trace, cancel: threading.Event,
           guide=None):  # fmt: skip
    """The decode loop: token k selected from `logits` ([1, 1, V]) — among those the grammar allows, with a `guide`
    — streamed as a Token event, then consumed for k+1 (a StepWanted) unless the request stops there. Returns the
    Reply (its stop reason, tokens, their StepLogprobs)."""
    cache = decoder.cache
    reply = Reply(req, tok, stream, trace, cache, cancel, guide)
    for _ in range(req.max_new_tokens):
        row = reply.row(logits[0, -1])  # [V]
        token, drawn = reply.choose(row, ids)
        event = reply.emit(token, row, drawn, cache.length)
        if event is None:
            break
        yield event
        if reply.done(cache.length):
            break
        logits = yield StepWanted(decoder, token)  # [1, 1, V]
        ids.append(token)
    return reply
