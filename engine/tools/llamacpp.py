"""llama.cpp as a reference engine for the benchmark, through llama-cpp-python's C API.

Token ids go in, greedy ids come out: the same prompt and the same loop as kvchat's benchmark,
timed the same way (the first token's time ends TTFT, the gaps after it are TPOT).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ..errors import EngineError
from ..trace import now

_QUIET = None


def quiet() -> None:
    """Silence llama.cpp's own logging (it prints every tensor while loading and quantizing)."""
    global _QUIET
    import llama_cpp as L

    if _QUIET is None:
        _QUIET = L.llama_log_callback(lambda level, text, user_data: None)  # kept alive here
        L.llama_log_set(_QUIET, ctypes.c_void_p())


class LlamaCpp:
    def __init__(self, gguf_path: Path, n_ctx: int, threads: int, n_batch: int = 512, repack: bool = True,
                 sequences: int = 1):  # fmt: skip
        """`repack`: llama.cpp's repacked CPU layouts (its default); off for a mixture of experts, whose repacked
        product dies with SIGSEGV on a prompt batch in llama-cpp-python 0.3.36 (engine/BENCHMARKS.md, "A mixture
        of experts"). `sequences`: how many run at once (`parallel`; n_ctx is then shared among them)."""
        import llama_cpp as L

        self.L = L
        quiet()
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        if not repack:
            mp.use_extra_bufts = False
        self.model = L.llama_model_load_from_file(str(gguf_path).encode(), mp)
        if not self.model:
            raise EngineError(f"llama.cpp could not load {gguf_path}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_threads, cp.n_threads_batch = threads, threads
        cp.n_seq_max = sequences
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise EngineError("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def _decode(self, ids: list[int]) -> int:
        """Consume ids (in batches); return the greedy next id from the last position's logits."""
        L = self.L
        for a in range(0, len(ids), self.n_batch):
            part = ids[a : a + self.n_batch]
            arr = (L.llama_token * len(part))(*part)
            rc = L.llama_decode(self.ctx, L.llama_batch_get_one(arr, len(part)))
            if rc != 0:
                raise EngineError(f"llama_decode failed with code {rc}")
        ptr = L.llama_get_logits_ith(self.ctx, -1)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def generate(self, prompt: list[int], n_new: int) -> tuple[list[int], float, list[float]]:
        """Greedy: (ids, start time, time of each token) on trace.now."""
        start = now()
        tok = self._decode(prompt)
        out, times = [tok], [now()]
        while len(out) < n_new:
            tok = self._decode([tok])
            out.append(tok)
            times.append(now())
        return out, start, times

    def parallel(self, prompts: list[list[int]], n_new: int) -> tuple[float, list[list[float]]]:
        """Greedy for several sequences at once, a sequence id each (llama.cpp's batch API, as its server's
        parallel slots run them): each prompt prefilled in batches of its own, then every decode step one batch of
        a token per sequence. (start time, each sequence's token times) on trace.now."""
        L, c = self.L, len(prompts)
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        batch = L.llama_batch_init(max(self.n_batch, c), 0, c)
        try:
            start = now()
            nxt, pos, times = [], [], [[] for _ in range(c)]
            for i, p in enumerate(prompts):
                for a in range(0, len(p), self.n_batch):
                    part = p[a : a + self.n_batch]
                    self._run(batch, [(t, a + j, i, a + j == len(p) - 1) for j, t in enumerate(part)])
                nxt.append(self._argmax(batch.n_tokens - 1))
                pos.append(len(p))
                times[i].append(now())
            while len(times[0]) < n_new:
                self._run(batch, [(nxt[i], pos[i], i, True) for i in range(c)])
                t = now()
                for i in range(c):
                    nxt[i], pos[i] = self._argmax(i), pos[i] + 1
                    times[i].append(t)
            return start, times
        finally:
            L.llama_batch_free(batch)

    def _run(self, batch, rows: list[tuple[int, int, int, bool]]) -> None:
        """Decode one batch of (token, position, sequence id, wants logits)."""
        batch.n_tokens = len(rows)
        for j, (tok, p, seq, logits) in enumerate(rows):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, p, 1
            batch.seq_id[j][0], batch.logits[j] = seq, 1 if logits else 0
        rc = self.L.llama_decode(self.ctx, batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc}")

    def _argmax(self, j: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, j)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def close(self) -> None:
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)
