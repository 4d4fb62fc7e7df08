"""Function tools of the LiveKit realtime model: the agent's tools in the system prompt, the model's
`<tool_call>`s as `llm.FunctionCall`s, the framework's results back as `<tool_response>` turns.

The rules are the chat template's (`omni_rt.tools`, shared with `omni-rt serve`); this module holds what
one `RealtimeSession` knows of them: which tools it offers, with what choice, and which calls its model
made (an output answers one of those, once).

The framework's loop (livekit-agents' `AgentActivity`, as with OpenAI's plugin): the reply's function
stream carries each call as soon as its `</tool_call>` arrives; the framework runs the tool, hands the
`FunctionCallOutput` back through `update_chat_ctx` and asks for the reply with `generate_reply`.
"""

from __future__ import annotations

import json
from typing import Any

from livekit.agents import llm, utils

from omni_rt import tools as template


class SessionTools:
    def __init__(self) -> None:
        self.context = llm.ToolContext.empty()
        self.functions: list[template.Function] = []
        self.choice: str | template.Function = "auto"
        self._made: dict[str, llm.FunctionCall] = {}  # call_id -> a call the model made
        self._answered: set[str] = set()  # call ids with an output

    def update(self, tools: list[Any]) -> None:
        """The tools offered from the next reply on; all or none (a tool omni_rt cannot offer is an
        error, and the tools stay as they were)."""
        functions = []
        for tool in tools:
            if isinstance(tool, llm.FunctionTool):
                schema = llm.utils.build_legacy_openai_schema(tool, internally_tagged=True)
            elif isinstance(tool, llm.RawFunctionTool):
                schema = tool.info.raw_schema
            else:  # a provider's own tool (a hosted search, ...) runs on that provider's servers
                raise llm.RealtimeError(
                    f"omni_rt runs function tools only: {type(tool).__name__} {getattr(tool, 'id', '')!r} "
                    "is not one"
                )
            functions.append(
                template.Function(schema["name"], schema.get("description"), schema.get("parameters"))
            )
        if len(functions) > template.MAX_TOOLS:
            raise llm.RealtimeError(
                f"omni_rt offers at most {template.MAX_TOOLS} tools, got {len(functions)}"
            )
        self.context, self.functions = llm.ToolContext(tools), functions

    def set_choice(self, choice: Any) -> None:
        """livekit's ToolChoice: "auto" (also None), "none", "required", or {"type": "function", ...}."""
        try:
            self.choice = template.choice_of(choice)
        except ValueError as e:  # the choice stays as it was
            raise llm.RealtimeError(f"omni_rt: {e}") from None

    def system_prompt(self, instructions: str | None) -> str:
        return template.system_prompt(instructions or "", self.functions, self.choice)

    def parser(self) -> template.ToolCallParser | None:
        return template.tool_parser(self.functions, self.choice)

    def made(self, call: template.ToolCall) -> llm.FunctionCall:
        """A call the model made, as the framework runs it."""
        item = llm.FunctionCall(call_id=utils.shortuuid("call_"), name=call.name, arguments=call.arguments)
        self._made[item.call_id] = item
        return item

    def turn(self, item: Any, answering: set[str]) -> tuple[str, str] | None:
        """A function item the framework adds to the chat context → the turn the next reply carries (a
        result), None (a call the model made: it said it already), or a `RealtimeError`. `answering`: the
        call ids answered by the items before it in the same update (each is answered once)."""
        made = self._made.get(item.call_id)
        if item.type == "function_call":
            if made is None or (made.name, _json(made.arguments)) != (item.name, _json(item.arguments)):
                raise llm.RealtimeError(
                    f"omni_rt takes back only the function calls its model made; {item.call_id!r} "
                    f"({item.name}) is not one"
                )
            return None
        if made is None:
            raise llm.RealtimeError(f"a function output for {item.call_id!r}, a call the model did not make")
        if item.call_id in self._answered or item.call_id in answering:
            raise llm.RealtimeError(f"a second function output for {item.call_id!r}")
        answering.add(item.call_id)
        return "user", template.tool_response(item.output)

    def answered(self, call_id: str) -> None:
        self._answered.add(call_id)

    def unanswered(self, call_id: str) -> None:
        """The call's output was removed before the model heard it: an output may answer it again."""
        self._answered.discard(call_id)


def _json(text: str) -> Any:
    """Arguments compared as JSON: the framework may write the same object with other spacing."""
    try:
        return json.loads(text)
    except ValueError:
        return text
