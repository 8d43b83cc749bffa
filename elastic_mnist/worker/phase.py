"""Where a worker's life is: one value at a time, set by worker/life.py alone and read by the stop request.

    python -c "from elastic_mnist.worker.phase import Phase; print([p.value for p in Phase])"
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    STARTING = "start-up"
    """Imports, flags, the build: nothing loaded yet."""
    FORMING = "forming a round"
    """The round's workers muster and form their process group."""
    TRAINING = "training"
    """A stop is a graceful one, at the group's next step boundary."""
    BETWEEN_ROUNDS = "between rounds"
    """Kept: the round's stand-in is gone and the next one not yet handed over. SIGTERM and SIGINT only end a
    round that already ended (torchrun stopping the stand-in it no longer needs); the node's end comes from the
    agent, and SIGHUP (the agent died) still counts."""
