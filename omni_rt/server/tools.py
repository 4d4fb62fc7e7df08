"""Function calling on the wire: `session.tools` and `tool_choice` as the Realtime protocol says them.

The template's rules (the tools in the system turn, `<tool_call>` in replies, `<tool_response>` back)
are `omni_rt.tools`, shared with the framework adapters (which install no server extra); this module
adds the protocol's models of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from omni_rt.tools import MAX_TOOLS, duplicate_names


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(default=None, max_length=4_000)
    parameters: dict[str, Any] | None = None


def tool_dicts(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Tools as the wire shows them (session.created/updated), and as two lists of them compare."""
    return [t.model_dump(exclude_none=True) for t in tools]


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


ToolChoice = Literal["auto", "none", "required"] | FunctionChoice


def _unique(tools: list[Tool]) -> list[Tool]:
    if message := duplicate_names(tools):
        raise ValueError(message)
    return tools


Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS), AfterValidator(_unique)]
