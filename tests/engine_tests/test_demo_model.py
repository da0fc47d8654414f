"""The bundled demo model: loads like any checkpoint, and the reference's 600 → 750 edit works end to end."""

import pytest
import torch

from engine.events import Finished, PrefillStarted
from engine.session import Request, Session
from engine.weights.loading import load_model

BUDGET = "I am planning a trip to Chengdu for 3 nights. My budget is 600 yuan."


def reply(session, messages, **kw):
    events = list(session.generate(Request(messages=messages, max_new_tokens=kw.pop("max_new_tokens", 96), **kw)))
    assert isinstance(events[-1], Finished), events[-1]
    return next(e for e in events if isinstance(e, PrefillStarted)), events[-1]


def test_the_600_to_750_yuan_edit_end_to_end(demo_model_dir):
    loaded = load_model(demo_model_dir)
    session = Session(loaded)
    _, first = reply(session, [{"role": "user", "content": BUDGET}])
    assert first.reason == "eos"
    assert "600 yuan" in first.text and "Chengdu" in first.text
    edited = [{"role": "user", "content": BUDGET.replace("600", "750")}]
    start, second = reply(session, edited)
    old_prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": BUDGET}])
    new_prompt = list(start.prompt_token_ids)
    edited_at = next(i for i, (a, b) in enumerate(zip(old_prompt, new_prompt)) if a != b)
    r = start.reuse
    assert r.first_invalidated_position == edited_at == r.reused  # reuse stops exactly at the edited token
    assert r.cached_token["text"] == "6" and r.new_token["text"] == "7"
    assert r.computed == len(new_prompt) - edited_at
    assert r.invalidated == len(old_prompt) + len(first.token_ids) - edited_at  # prompt tail + reply (eos unconsumed)
    assert "750 yuan" in second.text and "600" not in second.text


def test_a_follow_up_question_uses_the_conversation(demo_model_dir):
    session = Session(load_model(demo_model_dir))
    msgs = [{"role": "user", "content": BUDGET}]
    _, first = reply(session, msgs)
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "What is my budget?"}]
    start, second = reply(session, msgs)
    assert second.text == "Your budget is 600 yuan."
    assert start.reuse.reused >= len(session.loaded.tokenizer.apply_chat_template(msgs[:1]))


def test_greedy_tokens_match_transformers(demo_model_dir):
    transformers = pytest.importorskip("transformers")
    loaded = load_model(demo_model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    msgs = [{"role": "user", "content": BUDGET}]
    ref_tok = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    ids = ref_tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == loaded.tokenizer.apply_chat_template(msgs)
    out = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=60,
        do_sample=False,
        eos_token_id=sorted(loaded.tokenizer.stop_ids),
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    out = [t for t in out if t not in loaded.tokenizer.stop_ids]
    _, fin = reply(Session(loaded), msgs, max_new_tokens=60)
    assert list(fin.token_ids) == out


def test_stop_string_ends_the_reply_before_it(demo_model_dir):
    session = Session(load_model(demo_model_dir))
    _, fin = reply(session, [{"role": "user", "content": BUDGET}], stop_strings=("budget",))
    assert fin.reason == "stop_string" and "budget" not in fin.text and fin.text.startswith("Here is a plan")


def test_sampling_with_a_seed_is_reproducible(demo_model_dir):
    from engine.sampling import SamplingParams

    session = Session(load_model(demo_model_dir))
    p = SamplingParams(temperature=1.2, top_k=20, top_p=0.95, seed=11)
    a = reply(session, [{"role": "user", "content": BUDGET}], sampling=p)[1]
    b = reply(session, [{"role": "user", "content": BUDGET}], sampling=p)[1]
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("kv", ["none", "int8"])
def test_the_warm_up_at_load_runs_the_model_and_leaves_what_a_request_sees_untouched(demo_model_dir, kv):
    session = Session(load_model(demo_model_dir), kv=kv)
    assert session.facts()["warm_up_ms"] is None
    ms = session.warm_up()
    assert ms > 0 and session.facts()["warm_up_ms"] == ms
    assert session.cache.length == 0 and session.ids == [] and not session.traces and session.store.nodes == 0
    start, first = reply(session, [{"role": "user", "content": BUDGET}])
    assert start.reuse.reused == 0 and "600 yuan" in first.text  # the first request is as it would be without it
    session.set_model(load_model(demo_model_dir), kv=kv)
    assert session.facts()["warm_up_ms"] is None  # another load: to be warmed again
