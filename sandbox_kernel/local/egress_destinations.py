"""The destinations one sandbox asked its egress proxy for (a local engine extension, read
by `%egress learn`): per (host, port), how many connections the rules allowed and refused.

The host is the name the client asked for (the HTTP CONNECT or request host, the SOCKS5
domain name; the proxy normalizes it) or the IP literal it gave. A sandbox chooses how many
destinations it contacts, so the table holds at most MAX_DESTINATIONS distinct ones: past
that a new destination is only counted in `dropped`, while those already in it still count.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_DESTINATIONS = 1000


@dataclass
class Reached:
    allowed: int = 0
    refused: int = 0


class DestinationLog:
    def __init__(self, cap: int = MAX_DESTINATIONS) -> None:
        self.cap = cap
        self.table: dict[tuple[str, int], Reached] = {}
        self.dropped = 0  # connections to destinations that found the table full

    def seen(self, host: str, port: int, allowed: bool) -> None:
        key = (host, port)
        reached = self.table.get(key)
        if reached is None:
            if len(self.table) >= self.cap:
                self.dropped += 1
                return
            reached = self.table[key] = Reached()
        if allowed:
            reached.allowed += 1
        else:
            reached.refused += 1

    def clear(self) -> None:
        self.table.clear()
        self.dropped = 0
