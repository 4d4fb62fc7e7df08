"""Function calling of the pipecat service: the tools in the system prompt, the model's `<tool_call>`s run
through pipecat's own function-calling path (`LLMService.run_function_calls`: the handlers given to
`register_function`, or carried by the tools), the results back as `<tool_response>` turns.

The rules are the chat template's (`omni_rt.tools`, shared with `omni-rt serve` and the LiveKit model);
this module holds what one `OmniRtService` knows of them: the tools it offers (`LLMSetToolsFrame`, or the
context's), the tool choice (the context's), and the calls its model made that have no result yet.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import FunctionCallCancelFrame, FunctionCallResultFrame
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.services.llm_service import FunctionCallFromLLM
from pipecat.services.settings import is_given

from omni_rt import tools as template


class ToolCalls:
    def __init__(self, service: Any) -> None:
        self._service = service  # the LLMService that runs the calls
        self.functions: list[template.Function] = []
        self.choice: str | template.Function = "auto"
        self.context: LLMContext | None = None  # the latest, handed to the function handlers
        self._open: set[str] = set()  # tool_call_ids the model made, without a result yet
        self.results_waiting = False  # a result came since the last reply: the next answers it

    async def set_tools(self, tools: Any) -> None:
        """`LLMSetToolsFrame.tools` or a context's: a ToolsSchema, a list of FunctionSchemas or direct
        functions, or nothing. Provider-specific tools (a hosted search, ...) are an error, and the tools
        stay as they were."""
        if not is_given(tools) or not tools:
            self.functions = []
            return
        schema = tools if isinstance(tools, ToolsSchema) else ToolsSchema(standard_tools=tools)
        if schema.custom_tools:
            await self._service.push_error(
                "omni_rt runs function tools only: provider-specific tools (ToolsSchema.custom_tools) "
                "are not; the tools are unchanged"
            )
            return
        functions = [
            template.Function(t.name, t.description, t.to_default_dict()["parameters"])
            for t in schema.standard_tools
        ]
        if len(functions) > template.MAX_TOOLS:
            await self._service.push_error(f"omni_rt offers at most {template.MAX_TOOLS} tools")
            return
        if duplicate := template.duplicate_names(functions):
            await self._service.push_error(f"omni_rt: {duplicate}; the tools are unchanged")
            return
        self.functions = functions

    async def set_context(self, context: LLMContext) -> None:
        """A context frame's tools and tool choice, where it has them (else those set so far stay)."""
        self.context = context
        if is_given(context.tools):
            await self.set_tools(context.tools)
        choice = context.tool_choice
        if is_given(choice):
            try:
                self.choice = template.choice_of(choice)
            except ValueError as e:
                await self._service.push_error(f"omni_rt: {e}; the tool choice is unchanged")

    def system_prompt(self, instructions: str | None) -> str:
        return template.system_prompt(instructions or "", self.functions, self.choice)

    def parser(self) -> template.ToolCallParser | None:
        return template.tool_parser(self.functions, self.choice)

    async def run(self, call: template.ToolCall) -> None:
        """A call the model made, run as pipecat runs an LLM's (its handler, the frames the context
        aggregator records); the handler runs in a task of its own."""
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        self._open.add(call_id)
        await self._service.run_function_calls(
            [
                FunctionCallFromLLM(
                    function_name=call.name,
                    tool_call_id=call_id,
                    arguments=json.loads(call.arguments),
                    context=self.context if self.context is not None else LLMContext(),
                )
            ]
        )

    def result(self, frame: FunctionCallResultFrame | FunctionCallCancelFrame) -> tuple[str, str] | None:
        """The turn a call's final result, or its cancellation, is for the next reply: the template's tool
        response. None for a result of a call this model did not make (another service's, passing through)
        or an intermediate one (the call stays open for its final result)."""
        cancelled = isinstance(frame, FunctionCallCancelFrame)
        final = cancelled or (frame.properties.is_final if frame.properties else True)
        if frame.tool_call_id not in self._open or not final:
            return None
        self._open.discard(frame.tool_call_id)
        if cancelled:
            # "CANCELLED", as pipecat's context aggregator records it and OpenAI's realtime service tells its
            # model; a reply only where pipecat asks for one (a call past its deadline, not an interruption)
            self.results_waiting = self.results_waiting or frame.run_llm
            return "user", template.tool_response("CANCELLED")
        self.results_waiting = True
        # as JSON, strings too; no result "COMPLETED": what pipecat's context aggregator records for it
        result = json.dumps(frame.result, ensure_ascii=False) if frame.result else "COMPLETED"
        return "user", template.tool_response(result)
