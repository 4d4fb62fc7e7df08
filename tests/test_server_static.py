"""Odd HTTP requests to the page and /health: a plain 4xx, never a 500 with a traceback in the log."""

import asyncio

from omni_rt.server import Server, ServerSettings


async def http(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one raw HTTP/1.1 exchange (the server closes after each)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def req(method: str, path: bytes) -> bytes:
    return method.encode() + b" " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"


async def test_odd_paths_methods_and_head(caplog):
    async with Server(None, ServerSettings(port=0)) as server:
        port = server.port
        for path in (b"/app.js%00", b"/app.js\x00", b"/" + b"a" * 300, b"/" + b"a" * 300 + b"/b.js"):
            status, _, body = await http(port, req("GET", path))
            assert status == 404 and body == b"Not found.\n", path
        for method in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH"):
            for path in (b"/", b"/health"):
                status, headers, _ = await http(port, req(method, path))
                assert status == 405 and headers["allow"] == "GET, HEAD", (method, path)
        for path in (b"/", b"/health"):
            status, headers, body = await http(port, req("HEAD", path))
            _, got, full = await http(port, req("GET", path))
            assert status == 200 and body == b"" and int(headers["content-length"]) == len(full) > 0
            assert headers["content-type"] == got["content-type"]
            assert headers["server"] == "omni-rt"  # no library or Python version to match exploits to
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no "process_request failed"
