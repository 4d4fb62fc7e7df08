"""WebRTC signaling for one connection: one complete offer in, its answer out.

aiortc gathers every ICE candidate inside `setLocalDescription`, so one offer (the client's candidates
already gathered) and one answer are the whole exchange: no trickle, no renegotiation. What the answer
says to each part of an offer: audio gets the outgoing reply track (and the client's microphone, if
it sends one, is received); video is declined (`inactive`: nothing to decode for nothing); a data
channel is accepted, and `peer.py` decides what to do with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import unquote

from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription

from omni_rt.server.track import AudioOutputTrack


def ice_server(url: str) -> RTCIceServer:
    """`stun:host:port`, or `turn:USER:PASSWORD@host:port[?transport=udp]` with its credentials inline."""
    scheme, sep, rest = url.partition(":")
    if not sep or scheme not in ("stun", "stuns", "turn", "turns"):
        raise ValueError(f"not a STUN/TURN URL: {url!r}")
    if "@" not in rest:
        return RTCIceServer(urls=url)
    credentials, _, address = rest.rpartition("@")
    username, _, password = credentials.partition(":")
    return RTCIceServer(urls=f"{scheme}:{address}", username=unquote(username), credential=unquote(password))


def peer_connection(ice_servers: Sequence[str]) -> RTCPeerConnection:
    """A peer connection with only the given STUN/TURN servers (aiortc's default is a public STUN host)."""
    return RTCPeerConnection(RTCConfiguration(iceServers=[ice_server(url) for url in ice_servers]))


async def answer_offer(pc: RTCPeerConnection, sdp: str, track: AudioOutputTrack) -> tuple[str, bool]:
    """Apply the client's offer to `pc` and make the answer: `(answer SDP, whether track is sent)`.

    `track` rides the offer's audio; it is not sent when the offer has no audio or only sends audio
    (a microphone and nothing to play). Raises `ValueError` for an offer that cannot be used, or that
    has neither audio nor a data channel.
    """
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
    except Exception as exc:
        raise ValueError(f"the offer could not be used: {exc}") from None
    kinds = {t.kind for t in pc.getTransceivers()}
    if "audio" not in kinds and "m=application" not in sdp:
        raise ValueError("the offer has no audio and no data channel")
    for transceiver in pc.getTransceivers():
        if transceiver.kind != "audio":
            transceiver.direction = "inactive"
    if "audio" in kinds:
        # Added after setRemoteDescription and before createAnswer, so that it rides the offer's
        # audio transceiver even when the browser only receives (no microphone).
        pc.addTrack(track)
    try:
        await pc.setLocalDescription(await pc.createAnswer())
    except Exception as exc:
        raise ValueError(f"no answer to this offer: {exc}") from None
    _bad_text_as_bytes(pc)
    return pc.localDescription.sdp, _sends(pc, track)


def _bad_text_as_bytes(pc: RTCPeerConnection) -> bool:
    """Deliver a data-channel text message that is not UTF-8 as bytes, instead of letting it break the
    connection: aiortc decodes text inside its SCTP receive loop, where a UnicodeDecodeError ends the
    association with no word to the client. As bytes it reaches `protocol.parse_client_event`, which
    answers it like any malformed message (an `invalid_json` error). Wraps aiortc's private receive hook
    of this connection only; returns False (nothing done) if this aiortc has none."""
    from aiortc.rtcsctptransport import WEBRTC_BINARY, WEBRTC_STRING

    sctp = pc.sctp
    receive = getattr(sctp, "_data_channel_receive", None)
    if receive is None:
        return False

    async def receive_checked(stream_id: int, pp_id: int, data: bytes) -> None:
        if pp_id == WEBRTC_STRING:
            try:
                data.decode("utf8")
            except UnicodeDecodeError:
                pp_id = WEBRTC_BINARY
        await receive(stream_id, pp_id, data)

    sctp._data_channel_receive = receive_checked
    return True


def _sends(pc: RTCPeerConnection, track: AudioOutputTrack) -> bool:
    """Whether the answer lets `track` be sent (its transceiver's direction includes send)."""
    for transceiver in pc.getTransceivers():
        if transceiver.sender.track is track:
            return transceiver.currentDirection in ("sendrecv", "sendonly")
    return False
