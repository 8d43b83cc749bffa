"""Every key of ours in etcd and in a job's or a round's store, named once.

    python -c "from elastic_mnist.contract import keys; print(keys.STATE_LEAF, keys.CONFIG_ERROR_KEY)"

In etcd, under `{key_prefix}/{run_id}/` (etcd/client.py's run_key):
    STATE_LEAF      the rendezvous state: one key, torch's pickled state, sealed with the job secret
    STORE_LEAF/...  the job's store (rendezvous/store.py), holding CONFIG_ERROR_KEY and FINGERPRINT_KEY
    BEACONS_LEAF/   each agent's beacon (host:port it answers on), one key per node under its lease
In a round's store, the one torchrun hands that round's workers:
    MUSTER_PREFIX + rank                  each rank's arrival, before its process group forms
    CONTROL_PREFIX/{token}/agree|watch    the control plane's two gloo groups; .../alarm holds ALARM_KEY
Nothing else in the package spells these (tests/test_layout.py).
"""

STATE_LEAF = "state"
STORE_LEAF = "store"
BEACONS_LEAF = "probe"
# Set before a node closes the rendezvous for a worker's configuration error: the line every agent of the
# job, `elastic-mnist status` and `elastic-mnist local` end with.
CONFIG_ERROR_KEY = "elastic-mnist/config-error"
FINGERPRINT_KEY = "elastic-mnist/fingerprint"  # the job's flags, as the first node defined them
MUSTER_PREFIX = "elastic_mnist/muster/"
CONTROL_PREFIX = "elastic-mnist/control"
ALARM_KEY = "lost"  # rung by the first rank that finds a peer gone: every rank polls it
