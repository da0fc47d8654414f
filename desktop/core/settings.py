"""What a person sets (model or remote server, precision, sampling, system prompt) and where kvchat keeps its data.
No Qt here: the dialog and the QSettings file are in settings_dialog.py."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from engine.errors import EngineError
from engine.grammar import KINDS as GRAMMAR_KINDS
from engine.grammar import Grammar
from engine.http.remote import RemoteSpec
from engine.sampling import SamplingParams
from engine.session import OVERFLOW_POLICIES
from engine.spec import LoadSpec

from .tool_servers import ConfigError, ToolServer, read_servers


def data_dir() -> Path:
    """KVCHAT_DATA_DIR when set (tests, portable installs), else the platform's user data directory."""
    env = os.environ.get("KVCHAT_DATA_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("kvchat", appauthor=False))


# How a LoadSpec field is kept in the settings file: its key there, and the stored value that means None
# (the engine's own default). The keys are the ones kvchat has always written.
SPEC_KEYS = {"path": "model_dir"}
SPEC_DEFAULTS = {"path": "", "device": "auto", "dtype": "auto", "capacity": 0, "cache_budget": -1, "disk_cache": "",
                 "disk_budget": -1}  # fmt: skip
DISK_FOLDER = "kv-cache"  # the prefix store's disk tier, in the data folder: on unless its budget is 0


# What each conversation keeps as its own (taken from the app's settings when it is created).
CONVERSATION_FIELDS = (
    "system_prompt",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
    "seed",
    "overflow",
    "reply_format",
    "reply_grammar",
    "tools",
    "tool_choice",
)
RECENT_MODELS = 6  # the quick switcher's models
DEFAULT_OVERFLOW = "truncate-middle"  # the app's: the system prompt, the first turn and the latest turns stay
SYSTEM_PRESETS = {  # the Settings dialog's system prompts to start from
    "A helpful assistant": "You are a helpful assistant.",
    "Brief answers": "Answer in as few words as the question allows.",
    "A Python expert": "You are an expert Python programmer. Answer with working code and a short explanation.",
    "A translator to English": "Translate what the user writes into English. Reply with the translation only.",
}


@dataclasses.dataclass
class Settings:
    model: LoadSpec = LoadSpec()  # what to load: the record the worker, the CLI and the loader share
    system_prompt: str = ""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    seed: int = -1  # -1: random
    model_folders: str = ""  # folders the Models dialog also looks in, separated by os.pathsep
    backend: str = "local"  # local: the model above, on this computer | remote: an OpenAI-compatible server
    remote_url: str = ""  # the server's base URL, e.g. http://gpu-box:8000/v1
    remote_api_key: str = ""
    remote_model: str = ""  # "": the first the server lists
    theme: str = "system"  # system (the OS's colour scheme) | dark | light
    user_presets: str = ""  # the person's own system-prompt presets: a JSON object, name -> prompt
    token_alternatives: int = 5  # alternatives kept per token of a reply (0: only the chosen token's figures)
    token_colours: str = "off"  # a reply's tokens coloured by: off | probability | entropy | drafts
    speculative: str = ""  # drafts for a local model's replies: "" none | int4 | lookup | a draft model's path
    draft_tokens: int = 4  # tokens drafted a round at most (engine.speculative)
    overflow: str = DEFAULT_OVERFLOW  # a conversation longer than the cache: engine.session.OVERFLOW_POLICIES
    reply_format: str = ""  # structured output: "" text | json_object | json_schema | lark | gbnf (engine.grammar)
    reply_grammar: str = ""  # the JSON schema or grammar of json_schema, lark and gbnf (its text, kept whole)
    recent_models: str = ""  # the local models used lately, newest first: a JSON list of paths ("": the demo)
    mcp_servers: str = ""  # the MCP servers, {"mcpServers": {…}} as other apps write it (tool_servers.read_servers)
    tools: str = ""  # the tools a conversation offers the model: a JSON list of "server/tool" (tool_servers.tool_key)
    tool_choice: str = "auto"  # auto: the model decides | required: the first reply to a message calls one

    def own_presets(self) -> dict[str, str]:
        """The person's saved system-prompt presets (a damaged value reads as none)."""
        try:
            value = json.loads(self.user_presets or "{}")
        except ValueError:
            return {}
        if not isinstance(value, dict):
            return {}
        return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str) and k and v}

    def recent(self) -> list[str | None]:
        """The local models used lately, newest first (None: the bundled demo model); a damaged value reads
        as none."""
        try:
            value = json.loads(self.recent_models or "[]")
        except ValueError:
            return []
        if not isinstance(value, list):
            return []
        return [p or None for p in value if isinstance(p, str)][:RECENT_MODELS]

    def remember(self, path: str | None) -> None:
        """`path` (None: the demo model) is the newest of the recent models."""
        kept = [p for p in self.recent() if p != path]
        self.recent_models = json.dumps([path or "", *("" if p is None else p for p in kept)][:RECENT_MODELS])

    def conversation_summary(self, tools_off: str = "") -> str:
        """The conversation's own system prompt and sampling in a line (shown above its messages); `tools_off`: why
        its tools are not offered now, said beside them."""
        short = self.system_prompt[:80] + ("…" if len(self.system_prompt) > 80 else "")
        parts = [f"System prompt: “{short}”" if self.system_prompt else "No system prompt"]
        parts.append("greedy" if self.temperature == 0 else f"temperature {self.temperature:g}")
        off = {"top-k": 0, "top-p": 1.0, "min-p": 0.0, "repetition penalty": 1.0, "seed": -1}
        values = (self.top_k, self.top_p, self.min_p, self.repetition_penalty, self.seed)
        for (name, default), value in zip(off.items(), values):
            if value != default:
                parts.append(f"{name} {value:g}")
        parts.append(f"up to {self.max_new_tokens:,} new tokens")
        grammar = self.grammar_or_none()
        if grammar is not None:
            parts.append(f"replies: {grammar.describe()}")
        keys = self.tool_keys()
        if keys:
            must = ", a call required" if self.tool_choice == "required" else ""
            off = f" (off: {tools_off})" if tools_off else ""
            parts.append(f"{len(keys)} tool{'s' * (len(keys) != 1)}{must}{off}")
        parts.append(f"when the cache is full: {OVERFLOW_POLICIES.get(self.policy, self.policy)}")
        return " · ".join(parts)

    def grammar(self) -> Grammar | None:
        """The conversation's reply format as the engine takes it (None: plain text); EngineError where the stored
        schema or grammar is not one (the reply fails, saying why)."""
        if self.reply_format not in GRAMMAR_KINDS:
            return None
        if self.reply_format == "json_object":
            return Grammar.json_object()
        if self.reply_format == "json_schema":
            return Grammar.json_schema(self.reply_grammar)
        return Grammar(self.reply_format, self.reply_grammar)

    def grammar_or_none(self) -> Grammar | None:
        try:
            return self.grammar()
        except EngineError:
            return None

    def tool_keys(self) -> list[str]:
        """The tools this conversation offers ("server/tool"), a damaged value reading as none."""
        try:
            value = json.loads(self.tools or "[]")
        except ValueError:
            return []
        return [k for k in value if isinstance(k, str) and "/" in k] if isinstance(value, list) else []

    def tool_servers(self) -> dict[str, ToolServer]:
        """The configured MCP servers (a configuration that does not read: none; the Tools page says why)."""
        try:
            return read_servers(self.mcp_servers)
        except ConfigError:
            return {}

    @property
    def policy(self) -> str:
        """The overflow policy in force (a damaged stored value reads as the default)."""
        return self.overflow if self.overflow in OVERFLOW_POLICIES else DEFAULT_OVERFLOW

    def conversation_part(self) -> dict:
        """What a conversation keeps as its own: the system prompt and the sampling."""
        return {k: getattr(self, k) for k in CONVERSATION_FIELDS}

    def with_conversation(self, own: dict | None) -> Settings:
        """These settings with a conversation's own system prompt and sampling over them (values of the
        wrong type are ignored)."""
        keep = {k: v for k, v in (own or {}).items() if k in CONVERSATION_FIELDS and type(v) is type(getattr(self, k))}
        return dataclasses.replace(self, **keep)

    def engine(self) -> LoadSpec | RemoteSpec:
        """What the worker should run replies on: the local model, or the remote server."""
        if self.backend == "remote":
            return RemoteSpec(self.remote_url, self.remote_api_key, self.remote_model)
        if self.model.disk_cache is None:  # the app keeps conversations' K/V for later runs, in its data folder
            return dataclasses.replace(self.model, disk_cache=str(data_dir() / DISK_FOLDER))
        return self.model

    @property
    def folders(self) -> list[str]:
        return [f for f in self.model_folders.split(os.pathsep) if f]

    @classmethod
    def load(cls, qs) -> Settings:
        """From a QSettings (or anything with contains/value); a bad stored value keeps the default."""

        def stored(key, default):  # the stored value as the default's type; the default if absent or bad
            try:
                return type(default)(qs.value(key)) if qs.contains(key) else default
            except (TypeError, ValueError):
                return default

        spec = {}
        for f in dataclasses.fields(LoadSpec):
            default = SPEC_DEFAULTS.get(f.name, getattr(LoadSpec, f.name))
            value = stored(SPEC_KEYS.get(f.name, f.name), default)
            spec[f.name] = None if f.name in SPEC_DEFAULTS and value == default else value
        s = cls(model=LoadSpec(**spec))
        for f in dataclasses.fields(cls):
            if f.name != "model":
                setattr(s, f.name, stored(f.name, getattr(s, f.name)))
        return s

    def save(self, qs) -> None:
        for f in dataclasses.fields(LoadSpec):
            value = getattr(self.model, f.name)
            qs.setValue(SPEC_KEYS.get(f.name, f.name), SPEC_DEFAULTS.get(f.name) if value is None else value)
        for f in dataclasses.fields(self):
            if f.name != "model":
                qs.setValue(f.name, getattr(self, f.name))
        qs.sync()

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=None if self.seed < 0 else self.seed,
        )
