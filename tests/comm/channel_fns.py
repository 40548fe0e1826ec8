"""Helpers of the message-channel tests."""

import time


def take_all(ch, rank: int, n: int, name: str = "c") -> list:
    """Up to ``n`` messages of ``rank``'s channel ``name``, waiting at most 10 s for them."""
    got = []
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        got += ch.take(rank, name, 0.5, lambda: None)
    return got
