"""The words kvchat's server and its client share on the wire: OpenAI's finish reasons against the engine's
stop reasons, and the keys of the `kvchat` extension object a response carries beside OpenAI's fields."""

# The engine's stop reason -> OpenAI's finish_reason (what the server sends).
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "capacity": "length"}

# OpenAI's finish_reason -> the engine's stop reason (what the client reads; "stop" cannot tell eos from a
# stop string, and a server's content filter or tool call ends the reply as an end of text would).
STOP_REASONS = {"stop": "eos", "length": "max_new_tokens", "content_filter": "eos", "tool_calls": "eos"}

EXTENSION = "kvchat"  # the object beside OpenAI's fields: in a model card, a response and a stream's chunks

# Keys inside it.
REUSE = "reuse"  # the reuse report (ReuseReport.to_dict): a stream's first chunk, and the last
TRACE = "trace"  # the request's trace: the last chunk (its presence marks the final report)
CACHE = "cache"  # the working cache's figures, without the store's
STORE = "store"  # the prefix store's figures and tree
PROMPT_TOKENS = "prompt_tokens"  # positions in the prompt as the engine tokenized it
TOKENS = "tokens"  # tokens a content chunk carries, when more than one (made while the last chunk was sent)
ERROR = "error"  # a failed request's message, in the final report
