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
    def __init__(self, gguf_path: Path, n_ctx: int, threads: int, n_batch: int = 512, repack: bool = True):
        """`repack`: llama.cpp's repacked CPU layouts (its default); off for a mixture of experts, whose repacked
        product dies with SIGSEGV on a prompt batch in llama-cpp-python 0.3.36 (engine/BENCHMARKS.md, "A mixture
        of experts")."""
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

    def close(self) -> None:
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)
