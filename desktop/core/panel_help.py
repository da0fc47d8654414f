"""What each row of the inference panel measures, in a sentence: from which boundary to which, with the
formula where there is one (../README.md, "What the panel's figures mean", has them at length). Each row
shows its sentence as a tooltip and gives it to screen readers as the value's accessible description."""

from __future__ import annotations

ROW_HELP = {
    # Timing
    "ttftValue": "Time to first token: from the moment Send was pressed to the moment the engine had token 1 "
    "(t1 − arrival).",
    "ttftPartsValue": "TTFT split into its parts, in ms: waiting in the queue, rendering the chat template and "
    "tokenizing, computing the prompt (prefill), and selecting token 1. A remote engine: waiting to send, the "
    "server's own TTFT, and the rest (network, parsing).",
    "onScreenValue": "From Send to token 1 painted in the window, on TTFT's clock; the seam is what the window "
    "added after the engine had the token (on screen − TTFT, never below zero).",
    "tpotValue": "Time per output token after the first: (tn − t1) / (n − 1), the mean gap between tokens; "
    "— below two tokens.",
    "tokensPerSecondValue": "Tokens per second after the first: 1000 / TPOT.",
    "e2eValue": "End to end: from Send to the last token.",
    "meanInclWaitValue": "The whole request's duration divided by its tokens: TTFT's wait included, unlike TPOT.",
    "prefillRateValue": "Prompt positions actually computed per second; positions reused from a cache do not count.",
    "tokensValue": "Tokens this reply has (the stop token not counted).",
    "serverTimingValue": "Where the timing was measured: in this process, or a remote server's own figures when "
    "it reports them.",
    # Speculative decoding
    "draftValue": "What drafted this reply's tokens: the model itself quantized to int4, n-grams looked up in the "
    "conversation, or a smaller model with the same tokenizer (Settings → Speculative decoding); and how many it "
    "drafts a round at most (fewer while drafts are rejected, none while drafting does not pay).",
    "acceptedValue": "Drafted tokens the model accepted: it checked each in one pass over its weights and kept "
    "those it would have chosen itself (greedy), the first it would not replaced by its own. Accepted / drafted "
    "is the acceptance rate; for the int4 draft, how often 4-bit weights agree with the full ones on the next "
    "token.",
    "byPositionValue": "The acceptance at each place in a draft: the 2nd token counts only where the 1st was "
    "accepted, and so on.",
    "draftCostValue": "The time this reply spent drafting (the draft's own steps, or the lookup) and verifying "
    "(the model's passes over the drafted positions).",
    "speedupValue": "A token's time with drafts (from token 1 to the last, over the tokens after the first) "
    "against a plain decode step of the model (the median of this reply's steps where nothing was drafted), both "
    "measured in this reply on this machine: above 1× the drafts paid.",
    # Structured output
    "grammarValue": "What this reply had to parse as: a JSON schema, any JSON object, a Lark or GBNF grammar "
    "(Settings → Reply format); at each step the grammar said which tokens could come next and the model drew "
    "only among them.",
    "removedValue": "The probability the model had put on tokens the grammar forbade, at each step (under its own "
    "distribution: the softmax of its logits at temperature 1), averaged over the reply: how hard the grammar "
    "pushed against what the model would have written.",
    "overriddenValue": "Steps where the model's first choice was forbidden, so the token shown is not the one it "
    "preferred (its tooltip names the one it preferred).",
    "maskTimeValue": "The grammar's time per token: computing which tokens are allowed (llguidance), and how much "
    "of it the step waited for — on a GPU the mask is computed while the model runs its step.",
    # Confidence
    "meanLogprobValue": "The mean, over this reply's tokens, of each chosen token's log-probability under the "
    "model's own distribution (softmax of its logits at temperature 1, before any sampling setting). 0 is "
    "certain; lower is less sure.",
    "perplexityValue": "exp(−mean log-probability): as if the model had chosen uniformly among this many tokens "
    "at each step. 1 is certain.",
    "lowConfidenceValue": "Tokens the model gave less than a 50% chance (raw) but that were chosen: where it "
    "hesitated. Turn on the token colours to see them in the reply.",
    # KV cache
    "cachePositionsValue": "Positions a forward pass has consumed, of the capacity; they count every token of the "
    "prompt, the chat template's own tokens included.",
    "kvPayloadValue": "Bytes the cached positions' K and V take: 2 · L · T · H_kv · d · b (the row below fills "
    "in this model's numbers).",
    "kvAllocatedValue": "Bytes the cache really takes: the blocks of 16 positions it holds in the KV pool (its last "
    "block's unused positions included); a sliding-window model's cache, its preallocated buffers.",
    "kvPerPositionValue": "Bytes one cached position takes, K and V over every layer.",
    "kvFormulaValue": "2 (K and V) · L layers · T cached positions · H_kv KV heads · d head width · b bytes per "
    "value, with this model's numbers.",
    "stateValue": "A hybrid model's layers that keep a state instead of K/V (LFM2's short convolutions): the state's "
    "bytes, which do not grow with the positions, and the snapshots of it kept every 16 positions so that an edit "
    "can go back to the last one before it (the rest is recomputed).",
    "imagesValue": "The prompt's images: how many, the positions they take (each image's rows from the vision "
    "encoder, kept by content: a second question about the same image reuses them), their K/V bytes at this model's "
    "bytes per position, and the encoder's time (a part of TTFT of its own; none where their positions came from "
    "the cache).",
    "cachePointValue": "Which moment the cache figures describe: after prefill, or after consuming token k of n "
    "(the last token of a reply is selected, not yet consumed).",
    # Reuse
    "reuseSourceValue": "Where the reused positions came from: the working cache the model attends over, the "
    "prefix store (its blocks taken by reference, or copied back), or nothing.",
    "firstInvalidatedValue": "The first prompt position whose token differs from the cache's: from here on the "
    "cache is recomputed. Positions count the chat template's tokens too.",
    "tokenChangeValue": "The cached token and the new one at the first invalidated position (their vocabulary ids, "
    "not positions).",
    "reusedValue": "Prompt positions taken from a cache instead of computed: the longest common prefix of token "
    "ids, at most the prompt's length − 1.",
    "recomputedValue": "Prompt positions computed for this request (the prompt's length − reused).",
    "discardedValue": "Positions the working cache held past the first invalidated one, thrown away.",
    "droppedValue": "What the conversation's overflow policy left out of this request's prompt so that it fit the "
    "cache with room for the reply (Settings, This conversation, When the cache is full): whole turns, never the "
    "system prompt nor your last message. The positions after the first one left out changed, so the cache is "
    "cut there (the first invalidated position); the transcript marks the messages the model did not see.",
    "reuseReasonValue": "Why the whole cache was dropped, when it was (weights, dtype, tokenizer, rotary or "
    "attention settings, device or capacity changed).",
    # Prefix store
    "storeBytesValue": "Bytes the prefix store holds (each stored block counted once) and its budget. The "
    "tree's rows in italics, sizes in parentheses, are the working cache's own positions: outside the store, "
    "not counted here.",
    "storePrefixesValue": "Prompts the store holds, and the blocks of 16 positions they share.",
    "storeEvictionsValue": "Blocks evicted to stay under the budget, least recently used first.",
    "diskValue": "The prefix store's disk tier, in the data folder: blocks of 16 positions' K/V written after each "
    "reply and read back when a conversation returns, after a restart too, for the same model and settings "
    "(another model's, or this one's at another precision, are kept but never used). Bytes against its budget "
    "(Settings, Disk cache budget; 0 turns it off), blocks of this model, and how fast reads have been here.",
    "conversationCachedValue": "How much of the conversation shown is cached now: what the next Send reuses. When "
    "it is on disk, what a return costs, both measured on this machine: reading those positions (at the disk's "
    "read rate so far) against prefilling them (at this model's prefill rate, from this run or an earlier one).",
    # Model
    "modelNameValue": "The model loaded: its folder, file or the server's model id.",
    "architectureValue": "The model's architecture as its config names it.",
    "parametersValue": "The model's parameters, quantized codes counted as the values they stand for.",
    "dtypeValue": "The dtype the model computes in.",
    "precisionValue": "How the weights are stored (none: the dtype; int8/int4 and the group size; a file's own "
    "codes) and how the KV cache is stored.",
    "weightBytesValue": "Bytes the weights take in memory as held (codes and scales for quantized layers).",
    "fileTensorsValue": "A GGUF file's tensors by their type in the file and how kvchat holds them.",
    "deviceValue": "Where the model runs: the CPU, a GPU, or a remote server.",
    "kernelsValue": "What runs decode's one-row products: kvchat's C kernels (their instruction set and the "
    "compiler that built them) or torch, and why.",
    "layersValue": "Transformer blocks: L in the KV formula.",
    "kvHeadsValue": "Key/value heads (H_kv in the KV formula) and query heads; fewer KV heads make a smaller cache.",
    "headDimValue": "Values per head: d in the KV formula.",
    # Session
    "requestsValue": "Requests this session ran, failed and cancelled ones included.",
    "failedValue": "Requests that failed, and those stopped.",
    "medianTtftValue": "The median TTFT over this session's requests.",
    "medianTpotValue": "The median TPOT over this session's requests.",
}

PICTURE_HELP = {  # the pictures beside the rows: a tooltip each
    "cacheBar": "The selected reply's cache: positions it had consumed when it ended, of the capacity (after a "
    "load: the cache now). The map below is always the cache now.",
    "storeBar": "How full the prefix store is: the bytes its blocks hold, of its budget.",
    "storeTree": "The prompts the prefix store holds, as a tree: a shared beginning once, each branch below it; "
    "each row's positions, bytes and whether it is also on disk. A new prompt reuses the longest path it matches.",
}
