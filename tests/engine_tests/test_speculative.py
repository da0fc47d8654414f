"""Speculative decoding (engine.speculative): under greedy sampling a reply with drafts — the model itself in int4,
n-gram lookup, a smaller model with the same tokenizer — is token for token the model's alone, at every weight
precision, across the prefix store and an edit; the accept/reject rule keeps the target's distribution; rejected
drafts leave nothing in the working cache, the store or the disk tier; a draft with another tokenizer is refused
with the reason; and a drafting request runs beside others on the engine's lanes."""

import collections
import dataclasses
import threading

import pytest
import torch

from checkpoints import make_checkpoint
from engine.disk_store import DiskStore
from engine.drafters import LookupDrafter, same_tokenizer
from engine.events import Failed, Finished, PrefillStarted, Token
from engine.scheduler import END, EngineThread
from engine.session import Request, Session
from engine.speculative import Adaptive, SpecStats, accept_or_correct
from engine.weights.loading import load_model

REPEAT = list(range(40, 72))  # a prompt that holds its own continuation: lookup finds drafts there


@pytest.fixture(scope="module", params=["none", "int8", "int4"])
def target(request, llama_dir):
    return load_model(llama_dir, device="cpu", dtype="float32", weights=request.param)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A draft model in a folder of its own with the target's tokenizer: the tiny llama's own weights (seed 0), in
    float32 — so it agrees with the float target and mostly with its int8 and int4 copies."""
    return make_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=0)


def reply(session, ids, n=40, **kw):
    events = list(session.generate(Request(prompt_ids=tuple(ids), max_new_tokens=n, ignore_eos=True, **kw)))
    assert isinstance(events[-1], Finished), events[-1]
    return events


def drafts_of(events) -> str:
    return "".join({"accepted": "a", "corrected": "c", "target": "t"}[e.draft] for e in events if isinstance(e, Token))


def test_greedy_replies_with_every_kind_of_draft_are_the_models_alone(target, small_draft):
    """A conversation of three turns — a new message, an edit of the first, a return to the first branch through
    the prefix store — with no drafts, with the int4 copy (refused for an int4 model: its weights are 4-bit
    already), with lookup, and with a draft model: the same tokens, every turn, and the drafts really ran."""
    prompt = REPEAT + REPEAT[:9]
    kinds = [None, "lookup", str(small_draft)] + ([] if target.quantization.startswith("int4") else ["int4"])
    got = {}
    for kind in kinds:
        session = Session(target, capacity=512)
        first = reply(session, prompt, speculative=kind)
        edit = reply(session, [7, 8] + prompt[2:], speculative=kind)
        back = reply(session, prompt + list(first[-1].token_ids) + [9, 10], speculative=kind)
        got[kind] = [e[-1].token_ids for e in (first, edit, back)]
        if kind is not None:
            said = [e[-1].trace["speculative"] for e in (first, edit, back)]
            assert sum(s["drafted"] for s in said) > 0 and sum(s["accepted"] for s in said) > 0, (kind, said)
            assert "a" in drafts_of(first) + drafts_of(back), kind
        start = next(e for e in back if isinstance(e, PrefillStarted))
        assert start.reuse.source == "store" and start.reuse.reused > len(prompt), kind  # the first branch, back
    for kind in kinds[1:]:
        assert got[kind] == got[None], (target.quantization, kind)


def test_an_int4_draft_is_refused_for_a_model_already_4_bit(llama_dir):
    model = load_model(llama_dir, device="cpu", dtype="float32", weights="int4")
    events = list(Session(model).generate(Request(prompt_ids=(5, 6, 7), max_new_tokens=4, speculative="int4")))
    assert isinstance(events[-1], Failed) and "int4" in events[-1].error and "lookup" in events[-1].error
    assert not any(isinstance(e, PrefillStarted) for e in events)  # refused before anything was computed


def test_the_int4_draft_takes_a_scale_per_32_weights_and_int8_activations_where_the_kernels_have_them(llama_dir):
    """The int4 copy is the draft's own precision — 32 weights a scale (more of the target's next tokens agree than
    at the default 64) and integer products on int8 activations where this CPU's kernels have them (a cheaper
    step) — loaded once for the model and kept; the target's weights and activations stay what they were."""
    target = load_model(llama_dir, device="cpu", dtype="float32")
    session = Session(target, capacity=256)
    reply(session, REPEAT, n=12, speculative="int4")
    reply(session, REPEAT[:20], n=12, speculative="int4")
    (held,) = session.draft_models.values()
    draft = held[1]
    integer = draft.kernels is not None and "int4" in draft.kernels.integer_modes
    assert draft.quantization.startswith("int4/g32") and draft.activations == ("int8" if integer else "float32")
    assert target.quantization == "none" and target.activations == "float32"


def test_a_draft_model_with_another_tokenizer_is_refused_with_the_reason(llama_dir, demo_model_dir):
    model = load_model(llama_dir, device="cpu", dtype="float32")
    events = list(Session(model).generate(Request(prompt_ids=(5, 6, 7), max_new_tokens=4,
                                                 speculative=str(demo_model_dir))))  # fmt: skip
    assert isinstance(events[-1], Failed), events[-1]
    assert "cannot draft for" in events[-1].error and "tokenizer" in events[-1].error
    assert same_tokenizer(model, model) is None


def test_rejected_drafts_leave_nothing_in_the_cache_the_store_or_the_disk(llama_dir, tmp_path):
    """A reply whose drafts are mostly rejected (a random draft model): the working cache holds exactly the
    prompt and the reply's consumed tokens, each position's K/V bit for bit those of a reply without drafts, and
    the prefix store and the disk tier hold the same blocks, the same values."""
    model = load_model(llama_dir, device="cpu", dtype="float32")
    draft = make_checkpoint(tmp_path / "draft", "llama", seed=11)
    prompt = list(range(100, 160))
    plain = Session(model, capacity=256, disk=DiskStore(tmp_path / "plain", 10**9))
    spec = Session(model, capacity=256, disk=DiskStore(tmp_path / "spec", 10**9))
    a = reply(plain, prompt, n=50)[-1]
    b = reply(spec, prompt, n=50, speculative=str(draft))[-1]
    s = b.trace["speculative"]
    assert a.token_ids == b.token_ids and s["rolled_back"] > 0 and s["accepted"] < s["drafted"]
    n = len(prompt) + len(a.token_ids) - 1  # the last token is never consumed
    assert plain.cache.length == spec.cache.length == len(spec.ids) == n
    for x, y in zip(plain.cache.take(0, n), spec.cache.take(0, n)):
        assert torch.equal(x, y)
    other = list(range(5, 40))
    reply(plain, other, n=2)
    reply(spec, other, n=2)  # the first conversation goes to the store
    m1, m2 = plain.store.match(prompt), spec.store.match(prompt)
    assert m1.length == m2.length == len(prompt)
    for n1, n2 in zip(m1.path, m2.path):
        assert n1.tokens == n2.tokens and all(torch.equal(x, y) for x, y in zip(n1.parts(0, 16), n2.parts(0, 16)))
    plain.flush(), spec.flush()
    assert plain.disk.stats(plain.disk_fingerprint)["blocks"] == spec.disk.stats(spec.disk_fingerprint)["blocks"]


def test_the_accept_reject_rule_keeps_the_targets_distribution():
    """Draw a draft token from q, keep it or replace it by the rule, 40,000 times: the tokens that come out are
    distributed as p (a chi-square test), for a model's draft (q a distribution) and for lookup's (a point mass)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.02, 0.28])
    q = torch.tensor([0.30, 0.10, 0.20, 0.20, 0.15, 0.05])
    trials = 40_000
    for draft in (q, None):
        counts = collections.Counter()
        for _ in range(trials):
            token = 3 if draft is None else int(torch.multinomial(draft, 1, generator=gen))
            counts[accept_or_correct(p, draft, token, gen)[0]] += 1
        observed = torch.tensor([counts[i] for i in range(6)], dtype=torch.float64)
        expected = p.double() * trials
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (draft, observed / trials)  # 5 degrees of freedom: p > 0.001


def test_sampled_replies_with_drafts_are_the_same_for_the_same_seed(llama_dir, small_draft):
    """Sampling at temperature 0.9 with a draft model of the model's own weights: its drafts come from the model's own
    distribution (q = p), so the rule accepts every one; the same seed gives the same reply."""
    from engine.sampling import SamplingParams

    model = load_model(llama_dir, device="cpu", dtype="float32")
    sampling = SamplingParams(temperature=0.9, seed=3)
    a = reply(Session(model), REPEAT, n=30, sampling=sampling, speculative=str(small_draft))[-1]
    b = reply(Session(model), REPEAT, n=30, sampling=sampling, speculative=str(small_draft))[-1]
    s = a.trace["speculative"]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30 and s["drafted"] > 0
    assert s["acceptance"] > 0.9  # p = q: the rule takes (nearly) all (float rounding between the two passes aside)


def test_the_draft_length_follows_what_the_last_round_took_and_halves_where_drafting_does_not_pay():
    """A plain step first, timed (the least of the recent ones is a step's cost). Then, where a draft is dear (here
    0.45 of a step: a 4-bit file's verify row), a round drafts one past what the last one took (a rejected first
    token: one; the first round 2), twice as many after a round taken whole, up to k (a seeded sampled reply: k from
    the first round); k itself halves — 8, 4, 2, 1, and 3 (grown back) to 2 — while rounds cost more than a plain
    step a token, then nothing is drafted for a while — at once where not even a round of one draft would pay (a
    draft taken less often than its cost as a share of a step); rounds that cost what a plain step costs keep k;
    rounds well under a plain step grow k back by one."""
    plan = Adaptive(8)
    assert plan.now() == 0  # the first round is a plain step, timed: what drafting is weighed against
    plan.plain(14.0)  # the first after a prompt, slow
    plan.plain(10.0)
    assert plan.target_ms == 10.0  # a step's own cost: the least of the recent ones
    seen = []
    for taken in (0, 1, 1, 3, 4):
        seen.append(plan.now())
        plan.round(seen[-1], min(taken, seen[-1]) + 1, 10.0 + 4.5 * seen[-1])
    # the first round 2: 0 taken; 1 of 1, 1 of 2 (three rounds at 10.5 ms a token: k 8 -> 4), 2 of 2, 4 of 4
    assert seen == [2, 1, 2, 2, 4] and plan.k == 4 and plan.now() == 4
    assert plan.horizon() == 1  # two rounds after a miss so far: too few to weigh
    plan = Adaptive(8)
    plan.plain(10.0), plan.plain(10.0)
    seen = []
    for _ in range(12):
        seen.append(plan.now())
        plan.round(seen[-1], seen[-1] + 1, 10.5 * (seen[-1] + 1))  # every draft taken, dearer than a plain step
    assert seen == [2, 4, 8, 4, 4, 4, 2, 2, 2, 1, 1, 1] and plan.now() == 0
    plan = Adaptive(8)
    plan.plain(10.0)
    seen = []
    for _ in range(3):
        seen.append(plan.now())
        plan.round(seen[-1], 1, 10.0 + 5.0 * seen[-1])  # every first draft missed: rounds of 2, then 1
    assert seen == [2, 1, 1] and plan.now() == 0  # no draft taken, each a half step: a pause, not k 8 -> 4
    plan = Adaptive(8)
    plan.plain(10.0)
    for drafted, taken, ms in ((2, 0, 22.0), (1, 1, 17.0), (2, 0, 22.0)):
        plan.round(drafted, taken + 1, ms)  # a third of the drafts tested taken, each 0.62 of a step
    assert plan.now() == 0  # not even a round of one draft pays (1.33 tokens for 1.62 steps): a pause, not k 4
    plan = Adaptive(8)
    plan.plain(10.0)
    for drafted, taken, ms in ((2, 2, 16.0), (2, 0, 16.0), (2, 2, 16.0)):
        plan.round(drafted, taken + 1, ms)  # rounds taken whole or missed at once, as a run of copying goes
    assert plan.now() == 4 and plan.k == 8  # 7 tokens in 48 ms: as they ran, the drafts paid
    plan = Adaptive(8)
    plan.plain(15.0)  # the one plain step, on cold caches after the draft model's prefill
    for _ in range(3):
        plan.round(1, 2, 28.0, verify_ms=13.0)  # rounds at 14 ms a token: cheaper than 15, dearer than 13
    assert plan.target_ms == 13.0 and plan.k == 4  # a verify pass does a step's work and more: it bounds the step
    plan = Adaptive(8)
    plan.plain(10.0)
    plan.k = 1
    for _ in range(9):
        plan.round(1, 2, 19.5)  # two tokens at 0.975 of a plain step each: drafting holds on
    assert plan.k == 1 and plan.now() == 1
    seeded = Adaptive(8, fixed=True)  # a seeded sampled reply: k from its first round, whatever happens
    seeded.plain(10.0)
    assert seeded.now() == 8
    plan = Adaptive(8)
    plan.plain(10.0), plan.plain(10.0)
    plan.k = 3
    for _ in range(3):
        plan.round(3, 2, 25.0)  # one of three taken: a miss leaves a draft untested, so shorter rounds may pay
    assert plan.k == 2
    for _ in range(3):
        plan.round(2, 3, 10.0)  # three tokens a round at a step's time
    assert plan.k == 3


def test_the_step_a_reply_is_weighed_against_is_bounded_by_its_verify_passes():
    """The panel's speed-up weighs a drafted token against the target's plain step: the median of the reply's plain
    steps, or its least verify pass where that is less (a verify does a step's work and more; the one plain step of
    a reply that drafted throughout runs cold after the draft's prefill)."""
    stats = SpecStats(
        "int4", "the model itself in int4", 8, drafted=4, accepted=2, plain_ms=[15.0], checks=[14.0, 13.0]
    )
    report = stats.to_dict(tokens=10, seconds=0.11)
    assert report["target_step_ms"] == 13.0 and report["speedup"] == pytest.approx(13.0 / 11.0)
    stats.checks = [16.0]
    assert stats.to_dict(tokens=10, seconds=0.11)["target_step_ms"] == 15.0
    stats.checks = []  # drafting never ran (a reply too short): the plain steps alone
    assert stats.to_dict(tokens=10, seconds=0.11)["target_step_ms"] == 15.0
    stats.plain_ms = []
    assert stats.to_dict(tokens=10, seconds=0.11)["speedup"] is None  # no plain step: nothing to weigh against


def test_where_a_draft_is_cheap_a_round_drafts_on_past_a_miss_as_far_as_drafts_pay():
    """Rounds whose drafts cost nothing to make and 0.05 of a step each to verify (lookup's, in rows of a float model)
    and are taken half the time: the i-th draft of a round pays while 0.5^i > 0.05, so once three rounds have run a
    round drafts 4 even after a miss; at 0.45 of a step, one past what was taken, as before; a model's drafts keep
    the rule of runs; and where no draft is taken, k halves (lookup's drafts cost nothing to make)."""
    for cost, tokens, want in ((0.5, 2, 4), (4.5, 2, 1)):
        plan = Adaptive(8, free=True)
        plan.plain(10.0)
        for _ in range(3):
            assert plan.now() == (tokens if plan.tried else 2)  # the first round 2, then one past what was taken
            plan.round(2, tokens, 10.0 + cost * 2)  # a miss: 2 tokens, the first draft taken; 1, none
        assert plan.horizon() == want and plan.now() == max(want, tokens)
        plan.free = False  # a model's drafts: the rule of runs alone
        assert plan.horizon() == 1 and plan.now() == tokens
    plan = Adaptive(8, free=True)
    plan.plain(10.0)
    for _ in range(3):
        plan.round(2, 1, 11.0)  # nothing taken: a draft model's rounds would pause here; lookup's halve k
    assert plan.horizon() == 1 and plan.k == 4 and plan.now() == 1
    plan = Adaptive(8, free=True)  # every draft taken, each at a whole step's cost: none pays
    plan.plain(10.0)
    for _ in range(3):
        plan.round(1, 2, 20.0)
    assert plan.horizon() == 1


def test_lookup_copies_what_followed_the_longest_match_of_the_context():
    d = LookupDrafter()
    assert d.propose([1, 2, 3, 4, 5, 1, 2, 3], 3, None, None).tokens == [4, 5, 1]
    assert d.propose([9, 8, 7], 3, None, None).tokens == []
    assert d.propose([1, 2, 9, 5, 1, 2], 2, None, None).tokens == [9, 5]  # two tokens match
    assert d.propose([5, 1, 2, 3, 1, 2], 2, None, None).tokens == [3, 1]  # two alike: the most recent
    # [7, 1, 2] twice, [6, 7, 1, 2] once: the longer match, not the more recent
    assert d.propose([6, 7, 1, 2, 3, 9, 7, 1, 2, 5, 6, 7, 1, 2], 2, None, None).tokens == [3, 9]
    assert d.propose([3, 4, 3, 4], 1, None, None).tokens == [3]


def test_a_drafting_request_runs_beside_others_on_the_lanes(llama_dir):
    """Three requests at once, the second drafting with lookup: each equals its run alone, the others' decode steps
    batched, the drafting one's rounds between them."""
    model = load_model(llama_dir, device="cpu", dtype="float32")
    requests = [Request(prompt_ids=tuple(REPEAT[i:] + REPEAT), max_new_tokens=40, ignore_eos=True,
                        speculative="lookup" if i == 1 else None) for i in range(3)]  # fmt: skip
    alone = [list(Session(model).generate(r))[-1].token_ids for r in requests]
    engine = EngineThread(parallel=4)
    engine.session = engine.call(Session, model).result()
    events, done = [[], [], []], threading.Semaphore(0)

    def sink_for(i):
        return lambda ev: done.release() if ev is END else events[i].append(ev)

    tickets = [engine.submit(r, sink_for(i)) for i, r in enumerate(requests)]
    for _ in requests:
        assert done.acquire(timeout=120)
    assert [e[-1].token_ids for e in events] == alone
    assert events[1][-1].trace["speculative"]["accepted"] > 0
    # the others' steps batched together, and with the drafting one's plain steps (where it drafted nothing) when
    # those fall beside them
    assert 2 <= max(max(t.trace.batch_sizes or [1]) for t in (tickets[0], tickets[2])) <= 3
    assert tickets[1].trace.speculative.rounds > 0  # its verify passes ran on the lanes beside them
    engine.close(10)


def test_engine_serve_drafts_every_reply_and_counts_them_under_vllms_and_llama_cpps_names(llama_dir, tmp_path):
    """`engine serve --speculative int4`: each reply's kvchat report carries draft_n and draft_n_accepted (llama.cpp's
    names) and the trace's speculative counts; /metrics counts them under vLLM's names, parsed by prometheus-client;
    a draft that cannot draft (an int4 copy of a 4-bit model) stops the server at once with the reason."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from servers import engine_serve

    server = engine_serve(tmp_path, "--model", str(llama_dir), "--speculative", "int4", "--draft-tokens", "3")
    try:
        drafted = accepted = 0
        for i in range(2):
            body = {"model": llama_dir.name, "messages": [{"role": "user", "content": f"go {i}"}], "max_tokens": 24,
                    "ignore_eos": True}  # fmt: skip
            r = httpx.post(server.url + "/chat/completions", json=body, timeout=60).json()
            mine = r["kvchat"]
            spec = mine["trace"]["speculative"]
            assert spec["draft"] == "int4" and spec["k"] == 3 and mine["draft_n"] == spec["drafted"] > 0
            assert mine["draft_n_accepted"] == spec["accepted"] <= mine["draft_n"]
            drafted, accepted = drafted + mine["draft_n"], accepted + mine["draft_n_accepted"]
        text = httpx.get(server.root + "/metrics", timeout=10).text
        samples = {s.name + str(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
                   for s in f.samples}  # fmt: skip
        total = {k.split("[")[0]: v for k, v in samples.items() if "position" not in k}
        assert total["vllm:spec_decode_num_draft_tokens_total"] == drafted
        assert total["vllm:spec_decode_num_accepted_tokens_total"] == accepted
        per = [v for k, v in samples.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")]
        assert sum(per) == accepted and len(per) == 3
    finally:
        server.stop()
    import subprocess
    import sys

    refused = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", str(llama_dir), "--weights", "int4",
                              "--speculative", "int4"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "--speculative int4" in refused.stderr and "lookup" in refused.stderr


def test_a_draft_model_with_padded_embedding_rows_drafts_only_the_models_tokens(llama_dir, tmp_path):
    """A draft model of the same tokenizer whose embedding has 64 padding rows more (as checkpoints pad theirs): its
    proposals and its probabilities are over the model's tokens only, and the reply is the model's own, greedy and
    sampled alike (the rule weighs p and q over the same tokens)."""
    from engine.sampling import SamplingParams

    model = load_model(llama_dir, device="cpu", dtype="float32")
    padded = make_checkpoint(tmp_path / "padded", "llama", vocab_size=model.config.vocab_size + 64)
    plain = reply(Session(model), REPEAT, n=24)[-1]
    drafted = reply(Session(model), REPEAT, n=24, speculative=str(padded))[-1]
    assert drafted.token_ids == plain.token_ids and drafted.trace["speculative"]["drafted"] > 0
    sampled = reply(Session(model), REPEAT, n=24, sampling=SamplingParams(temperature=1.0, seed=1),
                    speculative=str(padded))[-1]  # fmt: skip
    assert max(sampled.token_ids) < model.config.vocab_size


def test_a_draft_model_catches_up_in_one_pass(llama_dir):
    """What a draft model lacks at a round's start — the last draft where all were taken and the token the target
    chose after it, or the tokens of plain steps — goes through it in one pass (its weights read once), and the
    drafts that follow are those of a draft model fed a token at a time."""
    from engine.backends import kernels
    from engine.drafters import ModelDrafter

    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    passes = []

    class Counting(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids, cache, **kw):
            passes.append(ids.shape[-1])
            return self.inner(ids, cache, **kw)

        def forward_spans(self, spans, every=False):
            out = self.inner.forward_spans(spans, every)
            if out is not None:  # rows of the batched decode step (None: the forward takes them)
                passes.append(("rows", sum(len(t) for t, _ in spans)))
            return out

    greedy = Request(prompt_ids=(1,)).sampling
    drafter = ModelDrafter(loaded, "m", "m", 128, loaded.config.vocab_size)
    one_by_one = ModelDrafter(loaded, "m", "m", 128, loaded.config.vocab_size)
    drafter.loaded = dataclasses.replace(loaded, model=Counting(loaded.model))
    drafter.prepare(REPEAT)
    first = drafter.propose(REPEAT + [5], 3, greedy, None).tokens
    # the prompt (32 positions: rows of the batched decode step where the kernels have it, not a forward that would
    # dequantize every weight of a quantized draft), then the token before the drafts, then a pass a draft
    rows = kernels.load() is not None  # the batched decode step is kvchat's kernels'
    assert passes == [("rows", len(REPEAT)) if rows else len(REPEAT), 1, 1, 1]
    taken = REPEAT + [5, *first, 9]  # all three taken, and the target's own after them
    passes.clear()
    again = drafter.propose(taken + [11, 12], 2, greedy, None).tokens  # and two plain steps' tokens
    assert passes == [4, 1]  # the last draft, 9, 11 and 12 in one pass; then one for the second draft
    one_by_one.prepare(REPEAT)
    for t in [5, *first, 9, 11]:
        one_by_one._consume([t])
    assert one_by_one.propose(taken + [11, 12], 2, greedy, None).tokens == again
