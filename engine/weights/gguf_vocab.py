"""A GGUF file's vocabulary (`tokenizer.ggml.*`) as a `tokenizers` tokenizer: byte-level BPE with llama.cpp's
pre-tokenizer split for the file's `tokenizer.ggml.pre`, or SentencePiece-style BPE with scores; control tokens
as special tokens, the file's chat template (run in the tokenizer's sandbox) and its stop ids."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import ModelLoadError
from ..tokenizer import Tokenizer
from ..user_cache import user_cache

NUMBER = (int, float)
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

# How text is split before byte-level BPE, by tokenizer.ggml.pre (llama.cpp's pre-tokenizer types)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")  # each digit its own piece, then GPT-2's split


def tokenizer(model, stop_extra=()):
    """A Tokenizer from tokenizer.ggml.*: byte-level BPE (model "gpt2") or SentencePiece-style BPE with
    scores (model "llama"), control tokens as special tokens, the file's chat template and stop ids. Built
    once per vocabulary: the built tokenizer is kept in the user cache under the digest of the file's whole
    metadata and of this builder (a second open reads it back in a few milliseconds; engine/BENCHMARKS.md,
    "Opening a model file")."""
    key = _cache_key(model)
    path = user_cache("tokenizers") / f"{key}.json"
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        tok = _from_kept(kept)
        stop = {int(i) for i in kept["stop"]} | {int(i) for i in stop_extra}
        _drop_vocabulary(model)
        return Tokenizer(tok, dict(kept["special"]), kept["template"], stop, str(kept["digest"]))
    except Exception:  # none kept (or unreadable, or from another version): build it
        pass
    tok, special, template, stop, digest = _build(model)
    try:  # written aside, then renamed: another process never reads half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = {
            **_kept_form(tok),
            "special": special,
            "template": template,
            "stop": sorted(stop),
            "digest": digest,
        }
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # only the next open's speed is at stake
    return Tokenizer(tok, special, template, stop | {int(i) for i in stop_extra}, digest)


BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback")


def _kept_form(tok) -> dict:
    """A built tokenizer as the user cache keeps it: its JSON without the BPE's vocabulary and merges, which go
    beside it as a JSON object (or the tokens in id order) and two lists, the merges' left and right parts. Read
    back (_from_kept), the BPE is built from those Python objects, quicker than tokenizers parses them inside its
    JSON (engine/BENCHMARKS.md, "Opening a model file")."""
    text = tok.to_str()
    whole = json.loads(text)
    bpe = whole.get("model") or {}
    merges = bpe.get("merges") or []
    if bpe.get("type") != "BPE" or not all(isinstance(m, list) and len(m) == 2 for m in merges):
        return {"tokenizer": text}
    vocab = bpe["vocab"]
    bpe["vocab"], bpe["merges"] = {}, []
    in_order = list(vocab) if list(vocab.values()) == list(range(len(vocab))) else None
    return {
        "skeleton": json.dumps(whole),
        "vocab": vocab if in_order is None else in_order,  # ids 0 .. n − 1 in order: the tokens alone
        "left": [a for a, _ in merges],
        "right": [b for _, b in merges],
    }


def _from_kept(kept: dict):
    """_kept_form's inverse: the same tokenizer, its BPE built from the kept vocabulary and merges."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    if "skeleton" not in kept:
        return HFTokenizer.from_str(kept["tokenizer"])
    tok = HFTokenizer.from_str(kept["skeleton"])
    bpe = json.loads(kept["skeleton"])["model"]
    options = {k: bpe[k] for k in BPE_OPTIONS if bpe.get(k) is not None}
    vocab, merges = kept["vocab"], list(zip(kept["left"], kept["right"]))
    if isinstance(vocab, list):
        vocab = dict(zip(vocab, range(len(vocab))))
    if not (isinstance(vocab, dict) and len(merges) == len(kept["left"]) == len(kept["right"])):
        raise ValueError("a kept tokenizer's vocabulary or merges are not whole")
    tok.model = models.BPE(vocab, merges, **options)
    return tok


def _cache_key(model) -> str:
    """What the built tokenizer depends on: the file's metadata bytes (tokens, merges, types, template, ids),
    this module's code and the tokenizers library's version."""
    import tokenizers

    h = hashlib.sha256(model.metadata_bytes())
    h.update(Path(__file__).read_bytes())
    h.update(tokenizers.__version__.encode())
    return h.hexdigest()[:32]


def _drop_vocabulary(model) -> None:
    """The parsed arrays (an object per token) go before the weights come."""
    for key in ("tokens", "merges", "scores", "token_type"):
        model.fields.pop(f"tokenizer.ggml.{key}", None)


def _build(model):
    """(tokenizers' Tokenizer, special tokens, chat template, stop ids, digest) from the file's metadata."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

    kind = model.meta("tokenizer.ggml.model")
    tokens = model.meta_as("tokenizer.ggml.tokens", [str])
    if not tokens:
        raise ModelLoadError("the GGUF file has no vocabulary (tokenizer.ggml.tokens)", model.path)
    types = model.meta_as("tokenizer.ggml.token_type", [int])
    types = [1] * len(tokens) if types is None or not len(types) else types.tolist()
    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for i, t in enumerate(tokens):
            vocab[t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))] = i
        merges = _known(vocab, [tuple(m.split(" ", 1)) for m in model.meta_as("tokenizer.ggml.merges", [str]) or []])
        tok = _bpe(model.path, vocab, merges, fuse_unk=False)
        pre = model.meta("tokenizer.ggml.pre", "default")
        if pre in SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif pre in DIGITS_FIRST:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
            )
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        special_ok = lambda t: set(t) <= alphabet
    elif kind == "llama":
        scores = model.meta_as("tokenizer.ggml.scores", [NUMBER])
        scores = [0.0] * len(tokens) if scores is None or not len(scores) else scores.tolist()
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = model.meta_as("tokenizer.ggml.merges", [str])
        merges = (
            _known(vocab, [tuple(m.split(" ", 1)) for m in merges]) if merges else _merges_from_scores(vocab, scores)
        )
        unk = model.meta("tokenizer.ggml.unknown_token_id", 0)
        unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
        tok = _bpe(model.path, vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
        prefix = model.meta("tokenizer.ggml.add_space_prefix", True)
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581")] * bool(prefix) + [normalizers.Replace(" ", "\u2581")]
        )
        strip = [decoders.Strip(" ", 1, 0)] if prefix else []
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
        )
        special_ok = lambda t: True
    else:
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)", model.path)
    control = [t for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL and special_ok(t)]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    def token(key):
        i = model.meta(f"tokenizer.ggml.{key}")
        return (i, tokens[i]) if isinstance(i, int) and 0 <= i < len(tokens) else (None, None)

    bos_id, bos = token("bos_token_id")
    add_bos = model.meta("tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    special = {}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
    ):
        _, text = token(key)
        if text is not None:
            special[name] = text
    stop = set()
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        i, _ = token(key)
        if i is not None:
            stop.add(i)
    _drop_vocabulary(model)
    template = model.meta_as("tokenizer.chat_template", str)
    digest = hashlib.sha256()
    for part in (kind or "", model.meta("tokenizer.ggml.pre", "") or "", template or "", str(len(tokens))):
        digest.update(part.encode())
    digest.update(tok.to_str().encode())
    return tok, special, template, stop, digest.hexdigest()


def _bpe(path, vocab, merges, **kw):
    """A tokenizers BPE over the file's vocabulary; a vocabulary it refuses is a clear error."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    try:
        return HFTokenizer(models.BPE(vocab, merges, **kw))
    except Exception as e:  # the Rust side raises plain Exception
        raise ModelLoadError(f"the GGUF vocabulary cannot be built: {e}", path) from None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (how byte-level vocabularies spell every byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _known(vocab: dict[str, int], merges: list[tuple]) -> list[tuple[str, str]]:
    """The merges whose two parts and whose result are tokens of the vocabulary (a file may carry others:
    llama.cpp never applies them, and tokenizers refuses them)."""
    return [m for m in merges if len(m) == 2 and m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]


def _merges_from_scores(vocab: dict[str, int], scores) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens of the
    vocabulary, best-scored token first (as transformers derives them)."""
    merges = []
    for token, score in zip(vocab, scores):
        local = [
            (token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]
