"""Function calling in Qwen3-Omni's chat template: the tools in the system turn, `<tool_call>` in replies.

Qwen3-Omni's template (its `tokenizer_config.json`, shared by the Qwen3 family) puts the tools in the
system turn, as JSON signatures inside `<tools></tools>`, and asks for each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a result comes back in a user turn inside
`<tool_response></tool_response>`. `<tool_call>` and `</tool_call>` are special tokens (ids 151657 and
151658), which the session's text deltas skip: the parser finds them by their ids.

`ToolCallParser` reads the Thinker's text deltas of one reply. Text before any call is the spoken
reply; from a `<tool_call>` on nothing is spoken (the reply's audio and transcript are dropped), and
each call is complete once its closing token arrives. A call that is not one JSON object with a known
`name` and object `arguments`, or one left open, fails closed: a `BadToolCall`, nothing to execute.

The one copy of these rules for everything that speaks the template: the server (`omni_rt.server.tools`
adds its protocol models) and the framework adapters (`omni_rt.integrations`), which install neither
pydantic models of their own nor the server's dependencies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from omni_rt.tokenizer import SPECIAL_TOKENS

_ID = {text: i for i, text in SPECIAL_TOKENS.items()}
TOOL_CALL, TOOL_CALL_END = _ID["<tool_call>"], _ID["</tool_call>"]
MAX_TOOLS = 128
MAX_CALL_CHARS = 16_000  # the arguments of one call


class Signature(Protocol):
    """What the template says of a function: the server's `Tool`, or `Function` below."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None


@dataclass(frozen=True)
class Function:
    """A function as the template lists it, from a framework's own tool (a LiveKit `@function_tool`, a
    pipecat schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Named(Protocol):
    """A tool choice that names the one function to call (the server's `FunctionChoice`)."""

    name: str


def system_prompt(instructions: str, tools: Sequence[Signature], choice: str | Named = "auto") -> str:
    """The system turn's text: the instructions, then the tools as the chat template writes them.
    `choice`: "auto", "none" (no tools offered), "required", or the one function to call."""
    if not tools or choice == "none":
        return instructions
    signatures = "\n".join(
        json.dumps(
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.parameters or {"type": "object", "properties": {}},
                },
            },
            ensure_ascii=False,
        )
        for t in tools
    )
    text = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    if choice == "required":
        text += "\n\nCall at least one function."
    elif not isinstance(choice, str):
        text += f"\n\nCall the function {choice.name}."
    return f"{instructions}\n\n{text}" if instructions else text


def duplicate_names(tools: Sequence[Signature]) -> str | None:
    """Why `tools` cannot be offered together, or None: two of one name (a call of it would run either)."""
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    return (
        f"tool names must be unique: {', '.join(map(repr, twice))[:200]} given more than once"
        if twice
        else None
    )


def choice_of(value: Any) -> str | Function:
    """A framework's tool choice as the template takes it: "auto" (also None), "none", "required", or
    OpenAI's `{"type": "function", "function": {"name": ...}}` (LiveKit's and pipecat's shape) as the one
    function to call. Anything else: ValueError saying what is accepted."""
    if value is None or (isinstance(value, str) and value in ("auto", "none", "required")):
        return value or "auto"
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(name, str) and name:
        return Function(name)
    raise ValueError(
        f"unknown tool_choice {value!r:.200}: 'auto', 'none', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}"
    )


def system_due(conversation: Sequence[Any], tokenizer: Any, system: str) -> str | None:
    """The system prompt a reply adds as a turn of its own once the conversation has begun: `system` where
    it is not the conversation's last system turn (instructions or tools changed since, or a truncation
    dropped the turn that said them), else None; None before anything was said too, when the session's
    first turn says its own instructions. The server and the framework adapters both ask this."""
    if not conversation:
        return None
    return None if system == (tokenizer.last_turn(conversation, "system") or "") else system


def tool_parser(tools: Sequence[Signature], choice: str | Named = "auto") -> ToolCallParser | None:
    """One reply's parser of `<tool_call>`s; None when no tools are offered (the reply is all speech)."""
    if not tools or choice == "none":
        return None
    return ToolCallParser(frozenset(t.name for t in tools))


def tool_response(output: str) -> str:
    """A function's result as the user turn the template feeds back."""
    return f"<tool_response>\n{output}\n</tool_response>"


def tool_call_text(name: str, arguments: str) -> str:
    """A call the client adds to the conversation, as the model would have written it."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class BadToolCall:
    message: str


@dataclass
class ToolCallParser:
    names: frozenset[str]
    calling: bool = False  # a <tool_call> came: nothing more of this reply is spoken
    _open: list[str] | None = None  # the text of the call being read
    _chars: int = 0
    _overlong: bool = False  # the call being read was too long: already an error, its close none

    def feed(self, delta: str, token_ids: list[int]) -> tuple[str, list[ToolCall | BadToolCall]]:
        """One text delta → (the text of it to speak, calls completed in it). A delta holds one token
        in the pipeline's stream; several are taken in order."""
        out: list[ToolCall | BadToolCall] = []
        speak = ""
        if TOOL_CALL not in token_ids and TOOL_CALL_END not in token_ids:
            if self._open is not None:
                self._chars += len(delta)
                if self._chars > MAX_CALL_CHARS:
                    self._open, self._overlong = None, True
                    out.append(BadToolCall(f"a tool call longer than {MAX_CALL_CHARS} characters"))
                else:
                    self._open.append(delta)
            elif not self.calling:
                speak = delta
            return speak, out
        for token in token_ids:
            if token == TOOL_CALL:
                self.calling = True
                if self._open is not None:
                    out.append(BadToolCall("a <tool_call> inside another"))
                self._open, self._chars, self._overlong = [], 0, False
            elif token == TOOL_CALL_END:
                if self._open is None:
                    if not self._overlong:
                        out.append(BadToolCall("a </tool_call> without its <tool_call>"))
                    self._overlong = False
                else:
                    out.append(self._parse("".join(self._open)))
                    self._open = None
        return speak, out

    def end(self) -> list[BadToolCall]:
        """The reply ended: a call still open is malformed."""
        if self._open is not None:
            self._open = None
            return [BadToolCall("the reply ended inside a <tool_call>")]
        return []

    def _parse(self, text: str) -> ToolCall | BadToolCall:
        try:
            call = json.loads(text)
        except ValueError as exc:
            return BadToolCall(f"a tool call that is not JSON: {exc}")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return BadToolCall('a tool call must be {"name": ..., "arguments": {...}}')
        if call["name"] not in self.names:
            return BadToolCall(f"a call of {call['name'][:64]!r}, which is not one of the session's tools")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return BadToolCall("tool call arguments that are not a JSON object")
        if not isinstance(arguments, dict):
            return BadToolCall("tool call arguments must be a JSON object")
        return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))
