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


def harmony_tokenizer(folder, template: str, vocab_size: int = 400) -> None:
    """A byte-level BPE tokenizer with harmony's markers as special tokens and `template`, written into `folder`."""
    raw = HFTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", *MARKERS],
                                  show_progress=False, initial_alphabet=alphabet)  # fmt: skip
    raw.train_from_iterator(TEXT, trainer)
    (folder / "tokenizer.json").write_text(raw.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|return|>"}))


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("harmony")
    harmony_tokenizer(folder, HARMONY)
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


HARMONY_TOOLS = (  # gpt-oss's template's tool parts: the tools shown, a call as a message to the function, a result
    "{%- if tools -%}<|start|>developer<|message|># Tools{%- for t in tools %} {{ t.function.name }}{%- endfor -%}"
    "<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.thinking -%}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif -%}"
    "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}<|start|>assistant to=functions.{{ c.function.name }}"
    "<|channel|>commentary json<|message|>{{ c.function.arguments|tojson }}<|call|>{%- endfor -%}"
    "{%- else -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}}  # fmt: skip


def test_a_message_to_a_function_is_a_call_not_text_streamed_or_read_whole(tok):
    """The analysis channel, then a message to `functions.get_weather` (the recipient in the channel's header, as
    the model writes it, or in the role's, as the template renders it): the stream shows the thinking only, and
    the reply read whole gives the same content and the call with its arguments."""
    from engine.tool_calls import parse_calls, template_format

    fmt = template_format(HARMONY_TOOLS)
    assert fmt is not None and fmt.name == "harmony"
    for header in ("<|channel|>commentary to=functions.get_weather <|constrain|>json",
                   "<|start|>assistant to=functions.get_weather<|channel|>commentary json"):  # fmt: skip
        reply = (
            "<|channel|>analysis<|message|>The user asks about Chengdu.<|end|>"
            f"<|start|>assistant{header}<|message|>" + '{"city": "Chengdu"}<|call|>'
        ).replace("<|start|>assistant<|start|>assistant", "<|start|>assistant")
        _, streamed, _ = _streamed(tok, reply)
        assert streamed == THINK_OPEN + "The user asks about Chengdu." + THINK_CLOSE
        content, calls = parse_calls(fmt, tok.decode(tok.encode(reply), skip_special_tokens=False))
        assert content == streamed
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Chengdu"}')]
    content, calls = parse_calls(fmt, "<|channel|>final<|message|>No call here.<|return|>")
    assert (content, calls) == ("No call here.", [])
    _, calls = parse_calls(fmt, '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Lhasa"}')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Lhasa"}')]  # its <|call|> a stop


def test_a_required_call_is_written_in_harmony_and_its_result_goes_back_through_the_template(tmp_path):
    """A tiny gpt-oss with a harmony tokenizer, `tool_choice` required: the reply is a message to the function with
    arguments in its schema (the grammar writes harmony's markers as their tokens), read back as the call; the next
    turn's prompt renders the call and its result as gpt-oss's template does."""
    import torch

    from checkpoints import FAMILY_CASES, make_checkpoint
    from engine.events import Finished
    from engine.session import Request, Session
    from engine.tool_calls import read_tools
    from engine.weights.loading import load_model

    folder = tmp_path / "oss"
    opts = dict(FAMILY_CASES["gpt_oss"], vocab_size=512)
    make_checkpoint(folder, opts.pop("family"), **opts)
    harmony_tokenizer(folder, HARMONY_TOOLS, vocab_size=500)  # (the model's 512 rows hold its 500 ids)
    loaded = load_model(folder, dtype="float32")
    assert loaded.tokenizer.harmony is not None
    torch.manual_seed(0)
    messages = [{"role": "user", "content": "What is the weather in Chengdu?"}]
    req = Request(messages=messages, max_new_tokens=120, tools=read_tools([WEATHER]), tool_choice="required")
    final = list(Session(loaded, capacity=256).generate(req))[-1]
    assert isinstance(final, Finished), final
    assert final.reason in ("eos", "grammar"), final.reason  # the call (its <|call|>) ends the reply
    assert len(final.tool_calls) == 1 and final.tool_calls[0].name == "get_weather"
    args = json.loads(final.tool_calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 12
    call = final.tool_calls[0]
    turn = messages + [
        {"role": "assistant", "content": final.text, "tool_calls": [call.to_dict()]},
        {"role": "tool", "name": "get_weather", "tool_call_id": call.id, "content": "Sunny, 24 °C"},
    ]
    prompt = loaded.tokenizer.decode(loaded.tokenizer.chat_prompt(turn).ids, skip_special_tokens=False)
    assert "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" in prompt
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>Sunny, 24 °C<|end|>" in prompt
