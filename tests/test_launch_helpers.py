"""The tests' own helpers that decide a failure: what counts as a server left listening."""

from __future__ import annotations

import socket

from tests.launch_helpers import left_listening, listeners


def test_a_port_still_held_by_its_server_counts_and_one_taken_by_another_does_not():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    before = listeners([port])
    assert list(before) == [port]
    assert left_listening(before) == [port]  # the same process still listens: left behind
    server.close()
    assert left_listening(before) == []
    assert left_listening({port: before[port] + 1}) == []  # (what a port taken again by another process looks like)
    again = socket.create_server(("127.0.0.1", port))  # this process again: counted
    try:
        assert left_listening(before) == [port]
    finally:
        again.close()
