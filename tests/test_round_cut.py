"""A round given up cuts the TCP connections it opened, and only those (elastic_mnist/graveyard.py): real
sockets of this process, a receive blocked in another thread woken by the cut."""

import socket
import threading

from elastic_mnist import graveyard


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return client, server


def test_the_rounds_connections_are_cut_and_what_came_before_stays():
    listener = socket.create_server(("127.0.0.1", 0))
    older = _pair(listener)  # e.g. a connection the process held before the round
    number = graveyard.begin_round()
    round_listener = socket.create_server(("127.0.0.1", 0))  # a store's server: outlives its round
    client, server = _pair(round_listener)
    got: list[bytes] = []
    waiting = threading.Thread(target=lambda: got.append(client.recv(10)))  # a collective waiting on a peer
    waiting.start()
    try:
        assert graveyard.cut_round(number - 1) == 0, "a round already over cuts nothing of this one"
        assert graveyard.cut_round(number) >= 2  # the round's two ends, not its listener, not the older pair
        waiting.join(timeout=10)
        assert not waiting.is_alive() and got == [b""], "the blocked receive ended at once"
        older[0].sendall(b"ok")
        assert older[1].recv(2) == b"ok", "a connection from before the round still works"
        third, accepted = _pair(round_listener)  # the listener still accepts
        third.close()
        accepted.close()
        assert client.fileno() >= 0, "shut down, not closed: its owner closes it"
    finally:
        for s in (listener, round_listener, client, server, *older):
            s.close()
        graveyard.begin_round()  # a round in this test process holds nothing of this test's
