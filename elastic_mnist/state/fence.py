"""Who owns a checkpoint directory, and whether its job is done: the generation fence and the finished marker.

    python -c "from elastic_mnist.state.fence import read_finished; print(read_finished('checkpoints'))"
"""

from __future__ import annotations

import json
import os
import time

from elastic_mnist.files import read_regular
from elastic_mnist.state.format import write_durable

GENERATION_FILE = ".generation"
FINISHED_FILE = "finished.json"
RECORD_CAP = 64 * 1024  # both records are one JSON line of ~100 bytes
# The keys each record of ours holds: a file under one of these names without them is another program's.
RECORD_KEYS = {GENERATION_FILE: {"token", "pid", "world_size", "time"},
               FINISHED_FILE: {"step", "total_steps", "test_accuracy", "run_id", "time"}}


def _record(directory: str, name: str):
    """A record's JSON; a FIFO or huge file in its place is refused unread (an OSError, like no file)."""
    return json.loads(read_regular(os.path.join(directory, name), RECORD_CAP, "record", "remove it"))


def new_token() -> str:
    return os.urandom(8).hex()


def claim_generation(directory: str, world_size: int, token: str | None = None) -> str:
    """Mark the checkpoint dir as owned by a freshly formed group: with shared storage rank 0 writes it,
    with node-local storage every writing rank writes rank 0's token into its own dir.

    A rendezvous can split (a live node declared dead keeps training while a new group forms); the
    older group then finds another token here at its next save and leaves, so its agent rejoins. With
    node-local dirs, any rank of the older group sharing a dir with a rank of the newer one finds it.
    """
    token = token or new_token()
    record = json.dumps({"token": token, "pid": os.getpid(), "world_size": world_size, "time": time.time()})
    write_durable(os.path.join(directory, GENERATION_FILE), record.encode(), replace=True)
    return token


def generation_is(directory: str, token: str) -> bool:
    try:
        return _record(directory, GENERATION_FILE)["token"] == token
    except (OSError, ValueError, KeyError, TypeError):
        return True  # unreadable: no evidence of a newer group


def foreign_records(directory: str) -> list[str]:
    """Paths of the records this runtime replaces (the fence, the finished marker) that it did not write: not
    a regular file, a symlink, or not one of its JSON records. Replacing them would destroy another program's
    file, so the directory is refused at start (state/manager.py)."""
    found = []
    for name, keys in RECORD_KEYS.items():
        path = os.path.join(directory, name)
        if not os.path.lexists(path):
            continue
        try:
            record = _record(directory, name)
        except (OSError, ValueError):
            record = None
        if not isinstance(record, dict) or not keys <= set(record):
            found.append(path)
    return found


def write_finished(directory: str, record: dict) -> None:
    """Rank 0 marks the job complete; a node or pod that arrives later reads it and exits 0."""
    write_durable(os.path.join(directory, FINISHED_FILE), json.dumps(record).encode(), replace=True)


def read_finished(directory: str) -> dict | None:
    """The completion record ({"step", "total_steps", "test_accuracy", "run_id", "time"}), or None."""
    try:
        record = _record(directory, FINISHED_FILE)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "step" in record else None
