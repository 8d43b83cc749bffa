"""How long a SIGKILLed process keeps its sockets open: the kernel unmaps its memory before it closes its
files, so the peers of a killed worker (hundreds of MB resident) see the connection reset only then.

    python -m bench.teardown          # prints {"0": ms, "256": ms, "768": ms} on this machine

The scale bench reports it beside a kill's detection time (scale.py).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

SIZES_MB = (0, 256, 768)
CHILD = """
import socket, sys, time
block = bytearray(int(sys.argv[1]) << 20)
block[::4096] = b"x" * len(block[::4096])  # every page resident
conn = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
conn.sendall(b"r")
time.sleep(600)
"""


def socket_close_ms(resident_mb: int) -> float:
    """Milliseconds from SIGKILL to the end of a TCP connection, for a process with this much memory."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)  # a child that dies before it connects (no memory for its block) fails, not hangs
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(resident_mb), str(server.getsockname()[1])])
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(60)
                conn.recv(1)
                start = time.perf_counter()
                child.send_signal(signal.SIGKILL)
                try:
                    conn.recv(1)  # EOF or a reset: either way the kernel has closed its end
                except ConnectionResetError:
                    pass
                return round((time.perf_counter() - start) * 1000, 1)
        finally:
            child.kill()
            child.wait()


def measure() -> dict[str, float]:
    return {str(mb): socket_close_ms(mb) for mb in SIZES_MB}


if __name__ == "__main__":
    print(json.dumps(measure()))
