"""WebRTC signaling for one connection: one complete offer in, its answer out.

aiortc gathers every ICE candidate inside `setLocalDescription`, so one offer (the client's candidates
already gathered) and one answer are the whole exchange: no trickle, no renegotiation. What the answer
says to each part of an offer: audio gets the outgoing reply track (and the client's microphone, if
it sends one, is received: the first audio section that sends, no other); video is declined (`inactive`: nothing to decode for nothing); a data
channel is accepted, and `peer.py` decides what to do with it.

ICE host candidates follow the server's bind address (`IcePolicy.for_bind`): a server on loopback
offers media on loopback alone, one bound to an interface offers that interface, and only a server
bound to all interfaces offers every interface (and uses its STUN/TURN servers). aiortc always gathers
on every interface (aioice's `get_host_addresses`); the policy of the connection being answered is
handed to that function through a context variable, so other connections in the process (clients,
other servers) gather as before. Behind a 1:1 NAT, `public_address` is announced in place of the
bound address (the NAT forwards it there).
"""

from __future__ import annotations

import contextvars
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

import aioice.ice
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


@dataclass(frozen=True)
class IcePolicy:
    """Where this server's media may flow: `addresses` to gather host candidates on (None: every
    interface), the STUN/TURN servers used, and an address announced in place of the bound one."""

    addresses: tuple[str, ...] | None = None
    ice_servers: tuple[str, ...] = ()
    public_address: str | None = None

    @classmethod
    def for_bind(
        cls, host: str, ice_servers: Sequence[str] = (), public_address: str | None = None
    ) -> IcePolicy:
        """The policy of a server listening on `host`: loopback → loopback only; one interface → it;
        all interfaces ("", 0.0.0.0, ::) → every interface, with `ice_servers`."""
        if host in ("", "0.0.0.0", "::"):
            return cls(None, tuple(ice_servers), public_address)
        name = host.strip("[]")
        if name.lower() == "localhost":
            name = "127.0.0.1"
        try:
            address = str(ipaddress.ip_address(name))
        except ValueError:  # a host name: the interface it names here
            address = socket.gethostbyname(name)
        # STUN/TURN are not used: a server bound to one address was asked to stay there.
        return cls((address,), (), public_address)

    def __post_init__(self) -> None:
        if self.public_address is not None:
            ipaddress.ip_address(self.public_address)  # ValueError for anything but an IP address


_policy: contextvars.ContextVar[IcePolicy | None] = contextvars.ContextVar("omni_rt_ice_policy", default=None)
_gather_all = aioice.ice.get_host_addresses


def _host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    policy = _policy.get()
    if policy is None or policy.addresses is None:
        return _gather_all(use_ipv4, use_ipv6)
    return [a for a in policy.addresses if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]


aioice.ice.get_host_addresses = _host_addresses


def peer_connection(policy: IcePolicy) -> RTCPeerConnection:
    """A peer connection with only the policy's STUN/TURN servers (aiortc's default is a public STUN host)."""
    return RTCPeerConnection(RTCConfiguration(iceServers=[ice_server(url) for url in policy.ice_servers]))


def _announce(sdp: str, policy: IcePolicy) -> str:
    """The answer with the public address in place of the bound one in host candidates and `c=`."""
    if policy.public_address is None:
        return sdp
    bound = set(policy.addresses or ())
    lines = []
    for line in sdp.split("\r\n"):
        if line.startswith("a=candidate:"):
            fields = line.split(" ")
            if len(fields) > 7 and fields[7] == "host" and (not bound or fields[4] in bound):
                fields[4] = policy.public_address
            line = " ".join(fields)
        elif line.startswith("c=IN IP") and (not bound or line.split(" ")[-1] in bound):
            version = "6" if ":" in policy.public_address else "4"
            line = f"c=IN IP{version} {policy.public_address}"
        lines.append(line)
    return "\r\n".join(lines)


async def answer_offer(
    pc: RTCPeerConnection, sdp: str, track: AudioOutputTrack, policy: IcePolicy = IcePolicy()
) -> tuple[str, bool]:
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
    _one_microphone(pc)
    token = _policy.set(policy)  # gathering happens inside setLocalDescription, in this context
    try:
        await pc.setLocalDescription(await pc.createAnswer())
    except Exception as exc:
        raise ValueError(f"no answer to this offer: {exc}") from None
    finally:
        _policy.reset(token)
    _bad_text_as_bytes(pc)
    return _announce(pc.localDescription.sdp, policy), _sends(pc, track)


def _one_microphone(pc: RTCPeerConnection) -> None:
    """Receive audio on the offer's first audio section that sends some, the microphone, and on no
    other: every received track is read as the one microphone (media.py), so a second one's frames
    would be interleaved with the first's in one input buffer and neither heard right. The others
    still carry the reply track if it rides them (a page that adds a receive-only transceiver, then
    its microphone, offers two sections)."""
    microphone = False
    for transceiver in pc.getTransceivers():
        # aiortc's record of the offer's direction for this section (it has no public one)
        if transceiver.kind != "audio" or "send" not in (transceiver._offerDirection or ""):
            continue
        if microphone:
            transceiver.direction = "sendonly" if transceiver.sender.track is not None else "inactive"
        microphone = True


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
