"""A minimal HTTP/1.1 server side for the fake engines of the gateway tests: faults need control of every
byte on the wire (a reset, a stall, a half-sent response), which a real framework would hide."""
from __future__ import annotations

import asyncio


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes, dict[str, str], bytes]:
    """(method, path, lower-cased headers, body) of the next request on a kept-alive connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    method, path = head.split(b" ")[:2]
    headers = {k.strip().lower(): v.strip() for k, _, v in (
        line.decode().partition(":") for line in head.split(b"\r\n")[1:] if b":" in line)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return method, path, headers, body


async def respond(writer: asyncio.StreamWriter, status: int, body: bytes, headers: str = "",
                  content_type: str = "application/json") -> None:
    """A whole response; `headers`: extra header lines, each ending in CRLF."""
    writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s"
                 % (status, content_type.encode(), len(body), headers.encode(), body))
    await writer.drain()
