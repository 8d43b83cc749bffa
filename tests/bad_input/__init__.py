"""The bad-input table (docs/bad-input.md) as rows, in the doc's order: tests/test_bad_input_table.py runs
each and checks that the doc's table is exactly these rows.

    cd tests && python -m bad_input     # prints the table; paste it over the one in docs/bad-input.md

To add a case: append a Row (bad_input/frame.py says what one is) to the list of its section, or add a
module with a list of its own to ROWS; print the table, paste it, run the test.
"""

from __future__ import annotations

from bad_input.dirs import DIRS
from bad_input.earlier import EARLIER
from bad_input.files import CACHE, CHECKPOINTS, ETCD, SECRETS
from bad_input.limits import CREDENTIALS, LIMITS
from bad_input.rendezvous import RDZV_CONF, REPLAYS, TRANSFER
from bad_input.storage import STORAGE

ROWS = [*DIRS, *CHECKPOINTS, *STORAGE, *SECRETS, *ETCD, *CACHE, *RDZV_CONF, *REPLAYS, *TRANSFER, *EARLIER, *LIMITS,
        *CREDENTIALS]
