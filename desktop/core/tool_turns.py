"""A conversation's tool loop, without Qt: the tools it offers (listed from their MCP servers), each call a reply
makes shown to the person and run only once allowed, its result stored as a `tool` message, and the next reply
made from it. The result is appended after every earlier position (the call as the reply made it, then the
result), so the loop computes only what it appends; the reuse rows say so."""

from __future__ import annotations

import asyncio

from engine.tool_calls import ToolCall

from .store import Message
from .tool_host import ServerTool, ToolResult

MAX_ROUNDS = 8  # replies with calls in a row, for one message of the person's; the ninth's calls are not run
DENIED = "The person did not allow this call."
STOPPED = "The person stopped the reply before this call ran."
DECISIONS = ("once", "conversation", "deny", "stop")  # what the person answers a call ("missing": no such tool)
ALLOWED_KEY = "tools_allowed"  # in a conversation's own settings: the tools allowed in it without asking


class ToolTurns:
    """The chat controller's tools (chat.ChatController is one); `tool_host` is set where servers are configured."""

    tool_host = None  # tool_host.ToolHost

    def _tools_init(self) -> None:
        self.tool_listing: dict[str, list[ServerTool]] = {}  # server → its tools, as it listed them
        self.tools_allowed: dict[int, set[str]] = {}  # conversation → tools allowed without asking (also stored)
        self.approvals: dict[int, asyncio.Future] = {}  # conversation → the call waiting for the person
        self.tools_halted: set[int] = set()  # conversations whose loop the person stopped

    # --- what a reply offers --------------------------------------------------------------------------------------
    def offered(self, cid: int | None) -> list[ServerTool]:
        """The tools conversation `cid` has on, of those its servers listed (none where the local model's chat
        template takes none: the summary line says so)."""
        keys = set(self.settings_for(cid).tool_keys())
        if not keys or self.tool_host is None or not self.model_takes_tools():
            return []
        return [t for tools in self.tool_listing.values() for t in tools if t.key in keys]

    def model_takes_tools(self) -> bool:
        """Whether the model in use can be offered tools: a local one's template teaches a format of calls (a
        remote server's is its own to say)."""
        facts = self.engine_facts or {}
        return facts.get("backend") == "remote" or "tool_format" not in facts or facts["tool_format"] is not None

    async def list_tools(self, cid: int) -> None:
        """Ask each server a conversation has a tool of for its tools, once while the app runs (a server that
        cannot be started is said, and its tools are not offered)."""
        if self.tool_host is None or not self.model_takes_tools():
            return
        servers = {k.split("/", 1)[0] for k in self.settings_for(cid).tool_keys()}
        for server in sorted(servers - set(self.tool_listing)):
            try:
                self.tool_listing[server] = await self.tool_host.tools(server)
            except Exception as e:  # a server that fails is said (the person reads why), never a crash
                self.listener.show_error(f"The tools of {server} are not offered: {e}")

    def tool_fields(self, cid: int | None, messages: list[dict]) -> dict:
        """The Request's tools: those on, `required` (one call) for the first reply to the person's message where
        the conversation asks for a call, else the model's choice."""
        tools = self.offered(cid)
        if not tools:
            return {}
        names = {}
        for t in tools:  # a name two servers share: the first server's
            names.setdefault(t.tool.name, t.tool)
        first = bool(messages) and messages[-1].get("role") == "user"
        required = first and self.settings_for(cid).tool_choice == "required"
        return {"tools": tuple(names.values()), "tool_choice": "required" if required else "auto",
                "parallel_tool_calls": not required}  # fmt: skip

    def owner(self, cid: int, name: str) -> ServerTool | None:
        """The tool a call names, of those conversation `cid` offers."""
        return next((t for t in self.offered(cid) if t.tool.name == name), None)

    # --- the loop -------------------------------------------------------------------------------------------------
    def take_calls(self, record: dict, stream, calls) -> None:
        """A reply that ended with `calls`: they go into its `record`, and those the loop runs (a single reply's, in
        a conversation with tools on) onto its `stream`, the conversation claimed for the loop meanwhile."""
        if not calls:
            return
        record["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
        if stream.alternative is None and self.offered(stream.cid):
            stream.calls = tuple(calls)
            self.runs[stream.cid] = self.runs.get(stream.cid, 0) + 1  # no Send while its calls run

    async def tool_round(self, cid: int, reply_mid: int, calls: tuple[ToolCall, ...], rounds: int):
        """Run the calls of reply `reply_mid` (each asked of the person first) and start the next reply from their
        results; its Stream, or None where the loop ends here. The conversation's claim taken for the loop is given
        back by that reply, or here where none starts."""
        started = False
        try:
            parent = reply_mid
            for call in calls:
                parent = await self._run_call(cid, parent, call)
                if parent is None:  # the store refused the result: the loop ends (the person has been told)
                    return None
                self.listener.transcript_changed()
            if cid in self.tools_halted:
                return None
            if rounds >= MAX_ROUNDS:
                self.listener.show_error(f"Tool calls stopped after {MAX_ROUNDS} replies in a row made them")
                return None
            self.guard(self.store.set_leaf, cid, parent)  # the branch the results are on, whatever is shown now
            upto = self.store.branch(cid)
            started, stream = True, None
            try:
                stream = await self._start_reply(cid, upto, parent, self.clock(), None, None, None, None, None)
            finally:
                self._ended(cid, stream)
            return stream
        finally:
            self.approvals.pop(cid, None)
            if not started:
                self._release(cid)
                self.listener.transcript_changed()

    async def _run_call(self, cid: int, parent: int, call: ToolCall) -> int | None:
        """One call: asked, run (or not) and its result stored after message `parent`; the result's id (None: the
        store refused it)."""
        tool = self.owner(cid, call.name)
        decision = "missing"
        if tool is None:
            result = ToolResult(f"No tool named {call.name!r} is offered in this conversation.", 0, error=True)
        elif cid in self.tools_halted:
            result, decision = ToolResult(STOPPED, 0, error=True), "stop"
        elif tool.key in self.allowed_tools(cid):
            decision = "conversation"
            result = await self.tool_host.call(tool.server, call.name, call.arguments)
        else:
            decision = await self._ask(cid, call, tool)
            if decision in ("once", "conversation"):
                if decision == "conversation":
                    self.allow_tool(cid, tool.key)
                result = await self.tool_host.call(tool.server, call.name, call.arguments)
            else:
                result = ToolResult(STOPPED if decision == "stop" else DENIED, 0, error=True)
                if decision == "stop":
                    self.tools_halted.add(cid)
        record = {"tool_call": {"id": call.id, "name": call.name, "arguments": call.arguments},
                  "server": tool.server if tool else None, "decision": decision, "size": result.size,
                  "cut": result.cut, "failed": result.error, "seconds": round(result.seconds, 3)}  # fmt: skip
        m: Message | None = self.guard(self.store.add_message, cid, parent, "tool", result.text)
        if m is not None:
            self.guard(self.store.update_message, m.id, trace=record)
        return None if m is None else m.id

    def allowed_tools(self, cid: int) -> set[str]:
        """The tools conversation `cid` runs without asking: allowed "in this conversation", kept with it (never
        taken from an imported file: an export does not carry them)."""
        own = self.store.conversation(cid).settings or {}
        kept = own.get(ALLOWED_KEY)
        stored = {k for k in kept if isinstance(k, str)} if isinstance(kept, list) else set()
        return stored | self.tools_allowed.get(cid, set())

    def allow_tool(self, cid: int, key: str) -> None:
        self.tools_allowed.setdefault(cid, set()).add(key)
        own = dict(self.store.conversation(cid).settings or {})
        own[ALLOWED_KEY] = sorted(self.allowed_tools(cid) | {key})
        self.guard(self.store.set_settings, cid, own)

    async def _ask(self, cid: int, call: ToolCall, tool: ServerTool) -> str:
        """The person's answer to a call (DECISIONS), from the window's approval."""
        future = self.listener.approve_call(cid, call, tool)
        self.approvals[cid] = future
        try:
            answer = await future
        except asyncio.CancelledError:
            answer = "stop"
        return answer if answer in DECISIONS else "deny"

    def stop_tools(self, cid: int | None) -> None:
        """Stop conversation `cid`'s tool loop: a call waiting for the person is not run, and no reply follows."""
        if cid is None:
            return
        if cid in self.runs:
            self.tools_halted.add(cid)
        future = self.approvals.get(cid)
        if future is not None and not future.done():
            future.set_result("stop")
