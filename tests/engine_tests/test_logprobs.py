"""What the model weighed at each step: the log-probabilities a Token carries, against transformers' logits and
against the sampler's own distribution."""

import math

import pytest
import torch

from checkpoints import make_checkpoint
from engine.events import Finished, Token
from engine.logprobs import reply_confidence, step_logprobs
from engine.sampling import SamplingParams, sampling_logits
from engine.session import Request
from engine.spec import LoadSpec

transformers = pytest.importorskip("transformers")


def run(session, req):
    tokens, final = [], None
    for ev in session.generate(req):
        if isinstance(ev, Token):
            tokens.append(ev)
        elif isinstance(ev, Finished):
            final = ev
    return tokens, final


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("logprobs"), "qwen2", tie=True)


def test_each_tokens_log_probabilities_are_log_softmax_of_transformers_logits(checkpoint):
    _, session = LoadSpec(path=str(checkpoint), dtype="float32").open()
    req = Request(prompt="hello there", max_new_tokens=12, logprobs=True, top_logprobs=5, ignore_eos=True)
    tokens, final = run(session, req)
    assert len(tokens) == 12 and len(final.logprobs) == 12
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompt = session.tokenize(req)
    ids = torch.tensor([prompt + [t.token_id for t in tokens]])
    with torch.no_grad():
        logits = ref(ids).logits[0]  # [T, V]
    for step, tok in enumerate(tokens):
        want = torch.log_softmax(logits[len(prompt) - 1 + step].double(), -1)  # [V]
        got = tok.logprobs
        assert got.logprob == pytest.approx(float(want[tok.token_id]), abs=1e-4)
        entropy = float(-(want.exp() * want).sum())
        assert got.entropy == pytest.approx(entropy, abs=1e-4)
        # top-k: sorted, the true top 5, and the chosen (greedy) token first with its own figure
        lps = [a.logprob for a in got.top]
        assert lps == sorted(lps, reverse=True) and len(got.top) == 5
        for a in got.top:
            assert a.logprob == pytest.approx(float(want[a.token_id]), abs=1e-4)
            assert a.text == session.loaded.tokenizer.token_text(a.token_id)
        assert set(torch.topk(want, 5).indices.tolist()) == {a.token_id for a in got.top}
        assert got.top[0].token_id == tok.token_id and got.rank == 1
        assert got.sampled_logprob == 0.0 and got.top[0].sampled_logprob == 0.0  # greedy: a point mass
        assert all(a.sampled_logprob is None for a in got.top[1:])
    assert [s.logprob for s in final.logprobs] == [t.logprobs.logprob for t in tokens]


def test_greedy_replies_are_the_same_with_logprobs_on_and_off(checkpoint):
    _, session = LoadSpec(path=str(checkpoint), dtype="float32").open()
    base = dict(prompt="a b c", max_new_tokens=16, ignore_eos=True)
    off, final_off = run(session, Request(**base))
    session.reset()
    on, final_on = run(session, Request(**base, logprobs=True, top_logprobs=20))
    assert final_off.token_ids == final_on.token_ids
    assert all(t.logprobs is None for t in off) and final_off.logprobs == ()
    assert all(len(t.logprobs.top) == 20 for t in on)


def test_the_sampled_figures_are_the_samplers_own_distribution(checkpoint):
    _, session = LoadSpec(path=str(checkpoint), dtype="float32").open()
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, repetition_penalty=1.3, seed=5)
    req = Request(prompt="once upon", max_new_tokens=10, sampling=params, logprobs=True, top_logprobs=10)
    tokens, _ = run(session, req)
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompt = session.tokenize(req)
    ids = prompt + [t.token_id for t in tokens]
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0]
    for step, tok in enumerate(tokens):
        at = len(prompt) - 1 + step
        seen = torch.tensor(ids[: at + 1])
        drawn = torch.log_softmax(sampling_logits(logits[at], params, seen), -1)  # what the sampler drew from
        got = tok.logprobs
        assert got.sampled_logprob == pytest.approx(float(drawn[tok.token_id]), abs=1e-4)
        p = drawn.exp()
        assert got.sampled_entropy == pytest.approx(float(torch.special.entr(p).sum()), abs=1e-4)
        for a in got.top:
            if math.isinf(float(drawn[a.token_id])):
                assert a.sampled_logprob is None  # filtered out: the sampler could not pick it
            else:
                assert a.sampled_logprob == pytest.approx(float(drawn[a.token_id]), abs=1e-4)
        raw = torch.log_softmax(logits[at], -1)
        assert got.rank == int((raw > raw[tok.token_id]).sum()) + 1
        if got.rank <= 10:  # the chosen token is among the alternatives with the same figure
            (mine,) = [a for a in got.top if a.token_id == tok.token_id]
            assert mine.logprob == pytest.approx(got.logprob)
    assert any(t.logprobs.sampled_logprob != pytest.approx(t.logprobs.logprob, abs=1e-3) for t in tokens)


def test_a_filtered_alternative_has_no_sampled_probability():
    raw = torch.tensor([3.0, 2.0, 1.0, 0.0])
    params = SamplingParams(temperature=1.0, top_k=2)
    drawn = sampling_logits(raw, params)
    got = step_logprobs(raw, drawn, 1, 4, False, str)
    assert [a.token_id for a in got.top] == [0, 1, 2, 3]
    assert got.top[2].sampled_logprob is None and got.top[3].sampled_logprob is None
    assert got.sampled_logprob == pytest.approx(math.log(math.exp(2) / (math.exp(3) + math.exp(2))))
    assert got.rank == 2 and got.logprob == pytest.approx(float(torch.log_softmax(raw, -1)[1]))


def test_top_logprobs_out_of_range_is_refused(checkpoint):
    _, session = LoadSpec(path=str(checkpoint), dtype="float32").open()
    tokens, _ = run(session, Request(prompt="x", max_new_tokens=2, logprobs=True, top_logprobs=21))
    assert tokens == []
    failed = list(session.generate(Request(prompt="x", max_new_tokens=2, logprobs=True, top_logprobs=-1)))[-1]
    assert "top_logprobs must be between 0 and 20" in failed.error


def test_a_replys_confidence():
    steps = [{"logprob": math.log(0.9)}, {"logprob": math.log(0.25)}, {"logprob": math.log(0.5)}]
    got = reply_confidence(steps)
    mean = (math.log(0.9) + math.log(0.25) + math.log(0.5)) / 3
    assert got == {"tokens": 3, "mean_logprob": pytest.approx(mean), "perplexity": pytest.approx(math.exp(-mean)),
                   "low_confidence": 1}  # fmt: skip
    assert reply_confidence([])["perplexity"] is None
