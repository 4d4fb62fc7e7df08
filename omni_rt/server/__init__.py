"""The WebRTC and WebSocket front end: browsers and realtime clients, each on its own `Session`.

Knows no tensors: it drives the public Session API only. Needs the `server` extra (aiortc, av,
websockets); `omni-rt serve` runs `app.main`.
"""

from omni_rt.server.app import Server, ServerSettings, find_web_dir, main
from omni_rt.server.peer import Peer, PeerSettings
from omni_rt.server.speech import TurnDetection
from omni_rt.server.track import AudioOutputTrack

__all__ = [
    "AudioOutputTrack",
    "Peer",
    "PeerSettings",
    "Server",
    "ServerSettings",
    "TurnDetection",
    "find_web_dir",
    "main",
]
