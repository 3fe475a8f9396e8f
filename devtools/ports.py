"""Free loopback ports for servers a test or a script starts."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, chosen by the kernel.

    Another process may take it before the caller binds it; every caller here starts its server
    at once, and a server that fails to bind exits, which the waits below report by name.
    """
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
