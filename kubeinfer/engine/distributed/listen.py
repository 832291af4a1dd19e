"""Rank 0's listening sockets (torch's TCPStore, the step channel) on the address the group meets at, not on
every interface.

`--master-addr` is normally one of rank 0's own addresses (127.0.0.1 on one node; the leader pod's name, which
resolves to its own IP, under the operator). When it is not (a virtual IP, an address behind NAT), binding
it fails; the group then listens on every interface of that address family, with a warning: refusing would
break such setups, and the step channel is still closed by the group secret (the TCPStore is not, there:
only the NetworkPolicy fences it)."""
from __future__ import annotations

import errno
import logging
import socket
import time

logger = logging.getLogger(__name__)
# A pod's own name in its headless Service may resolve a moment after the pod starts (the workers retry too).
RESOLVE_S = 30.0


def _resolve(host: str, port: int, patience_s: float) -> list:
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            if time.monotonic() > deadline:
                raise OSError(f"the tensor-parallel master address {host!r} does not resolve ({error}); "
                              "--master-addr must name rank 0's node") from None
            time.sleep(0.5)


def listen_on(host: str, port: int, backlog: int = 64, resolve_s: float = RESOLVE_S) -> socket.socket:
    """A listening TCP socket on `host`:`port` (port 0: the system picks)."""
    infos = _resolve(host, port, resolve_s)
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(backlog)
            return sock
        except OSError as error:
            sock.close()
            if error.errno != errno.EADDRNOTAVAIL:
                raise
    logger.warning("the tensor-parallel master address %s is not an address of this machine: listening on port %d "
                   "of every interface instead (the step channel still admits only ranks holding the group secret; "
                   "keep the group's ports behind a NetworkPolicy)", host, port)
    family = infos[0][0]
    return socket.create_server(("::" if family == socket.AF_INET6 else "0.0.0.0", port), family=family,
                                backlog=backlog)
