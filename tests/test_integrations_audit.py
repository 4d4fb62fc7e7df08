"""Both framework adapters driven at odd moments, as an outside tester drives them with the frameworks
unmodified: chat items edited before the model heard them. Scripted engines (no torch sampling): the
prompts each reply was given are what the tests read; steps are ordered by events, never sleeps."""

from __future__ import annotations

import asyncio

from integrations_support import scripted_engine
from livekit.agents import llm
from test_integrations_livekit import WAIT_S, message

from omni_rt.integrations.livekit import RealtimeModel
from omni_rt.model.config import preset
from omni_rt.tokenizer import Tokenizer

TOK = Tokenizer.tiny(preset("tiny").ids)  # the scripted engines'


def holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


async def play(created: llm.GenerationCreatedEvent) -> int:
    """Read a generation's audio to its end, as the framework plays it; the samples it carried."""
    return sum([f.samples_per_channel async for f in (await message(created)).audio_stream])


# -- LiveKit: chat context edits ------------------------------------------------------------------------


async def test_livekit_items_deleted_or_edited_before_the_model_heard_them_are_not_said() -> None:
    """The agent adds two messages, then deletes the first and edits the second before any reply (the
    framework hands its chat context back through update_chat_ctx): the reply's prompt has the edit and not
    the deleted message, which was still sent to the model as it was first added."""
    engine = scripted_engine(TOK.encode("Fine."))
    async with engine:
        model = RealtimeModel(engine)
        rt = model.session(turn_detection_disabled=True)
        ctx = rt.chat_ctx
        ctx.add_message(role="user", content="My PIN is 1234.")
        ctx.add_message(role="user", content="Hello.")
        ctx.add_message(role="user", content="Bye.")
        await rt.update_chat_ctx(ctx)
        ctx = rt.chat_ctx
        del ctx.items[0]
        ctx.items[0].content = ["Hello there."]
        ctx.items.reverse()  # and the order of what is still unheard follows the context's
        await rt.update_chat_ctx(ctx)
        assert [i.text_content for i in rt.chat_ctx.items] == ["Bye.", "Hello there."]
        await play(await asyncio.wait_for(rt.generate_reply(), WAIT_S))
        (prompt,) = engine.prompts
        assert not holds(prompt, TOK.encode("PIN"))
        assert holds(prompt, TOK.chat_prompt([("user", "Bye."), ("user", "Hello there.")]))
        # once heard, an item cannot be removed (the caches cannot be rewound)
        ctx = rt.chat_ctx
        del ctx.items[0]
        try:
            await rt.update_chat_ctx(ctx)
        except llm.RealtimeError as e:
            assert "already heard" in str(e)
        else:
            raise AssertionError("a heard item was removed without an error")
        await rt.aclose()
        await model.aclose()
