"""gpt-oss's harmony format: a reply's analysis channel read as a thinking block and its final channel as the answer,
streamed token by token; a stored reply's thinking handed back to the template as the message's `thinking`."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from checkpoints import TEXT
from engine.harmony import THINK_CLOSE, THINK_OPEN
from engine.tokenizer import Tokenizer

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
HARMONY = (  # the shape of gpt-oss's template: each message a header and a body, an assistant's thinking apart
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.thinking -%}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    raw = HFTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", *MARKERS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    raw.train_from_iterator(TEXT, trainer)
    folder = tmp_path_factory.mktemp("harmony")
    (folder / "tokenizer.json").write_text(raw.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": HARMONY, "eos_token": "<|return|>"}))
    return Tokenizer.from_dir(folder)


def _streamed(tok: Tokenizer, text: str, start: int = 0) -> tuple[list[str], str, str]:
    """The deltas of `text`'s ids pushed one by one after its first `start` ids (a forced start), the whole text, and
    the text after the start."""
    ids = tok.encode(text)
    stream = tok.stream(ids[:start])
    deltas = [stream.push(i) for i in ids[start:]]
    stream.finish()
    return deltas, stream.text, stream.new_text


def test_the_analysis_channel_streams_as_a_thinking_block_and_the_final_one_as_the_answer(tok):
    reply = (
        "<|channel|>analysis<|message|>The budget was 600, then 750.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Your budget is 750 yuan."
    )
    deltas, text, _ = _streamed(tok, reply)
    assert text == THINK_OPEN + "The budget was 600, then 750." + THINK_CLOSE + "Your budget is 750 yuan."
    assert "".join(deltas) == text and "" in deltas  # the headers' tokens show nothing
    assert deltas.index(THINK_OPEN) < deltas.index(THINK_CLOSE)  # opened and closed as the markers came


def test_a_reply_straight_to_its_final_channel_has_no_thinking_and_a_forced_start_counts_as_written(tok):
    _, text, _ = _streamed(tok, "<|channel|>final<|message|>Hello world!")
    assert text == "Hello world!"
    header = len(tok.encode("<|channel|>analysis<|message|>"))
    _, text, after = _streamed(tok, "<|channel|>analysis<|message|>Let me see.<|end|>", start=header)
    assert text == THINK_OPEN + "Let me see." + THINK_CLOSE and after == text[len(THINK_OPEN) :]
    _, text, _ = _streamed(tok, "<|channel|>analysis<|message|>Stopped mid-thought")
    assert text == THINK_OPEN + "Stopped mid-thought"  # left open: the app reads it as still thinking


def test_a_stored_replys_thinking_goes_back_to_the_template_as_its_field(tok):
    messages = [
        {"role": "user", "content": "My budget is 600 yuan."},
        {"role": "assistant", "content": "<think>\nThe user said 600.\n</think>\n\nNoted: 600 yuan."},
        {"role": "user", "content": "Actually, make it 750 yuan."},
    ]
    text = tok.render(messages)  # as the template sees the messages it is given
    assert "<think>" in text  # rendering alone hands the messages over as they are
    prompt = tok.decode(tok.chat_prompt(messages).ids, skip_special_tokens=False)
    assert "<|channel|>analysis<|message|>The user said 600.<|end|>" in prompt
    assert "<|channel|>final<|message|>Noted: 600 yuan.<|end|>" in prompt and "<think>" not in prompt
    assert prompt.endswith("<|start|>assistant")
