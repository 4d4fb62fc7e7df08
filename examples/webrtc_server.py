"""A WebRTC voice server embedded in your own asyncio program: the demo page and `/ws` on one port.

    python examples/webrtc_server.py [--port 8080]   # then open the printed URL in Chrome or Firefox

Each browser tab gets its own Session on the one engine; audio goes out on a 48 kHz WebRTC track,
events on the `events` data channel (docs/protocol.md). `omni-rt serve` is this, with flags.
"""

import argparse
import asyncio
import secrets

import omni_rt
from omni_rt.server import PeerSettings, Server, ServerSettings


async def main(port: int) -> None:
    engine = omni_rt.Engine.load("tiny")  # or a checkpoint directory, device="cuda"
    settings = ServerSettings(
        host="127.0.0.1",
        port=port,
        token=secrets.token_urlsafe(8),  # the printed URL carries it; other pages can't connect
        max_sessions=4,
        peer=PeerSettings(voice="ethan", instructions="You are a friendly assistant. Answer briefly."),
    )
    async with engine, Server(engine, settings) as server:
        print(f"open {server.url}", flush=True)
        while True:  # your app's own work goes here; the server runs beside it
            await asyncio.sleep(10)
            print(f"{len(server.peers)} browser(s) connected")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A WebRTC voice server inside an asyncio program.")
    parser.add_argument("--port", type=int, default=8080, help="port for the page and /ws (0: any free one)")
    asyncio.run(main(parser.parse_args().port))
