"""Rows of the bad-input table: the rendezvous (--rdzv-conf values, values written back into etcd by
someone without the secret) and the state a peer sends over the process group.

    cd tests && python -m bad_input     # the whole table
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

from bad_input.frame import SECRET, UNREACHABLE, Attempt, Ctx, Outcome, Row, cli, place_itself, raises, rdzv, warned
from elastic_mnist.procs import child_env


def _preflight(conf: str) -> Attempt:
    return lambda target, ctx: cli(ctx, ["preflight", f"--rdzv-conf={conf}", "--data-dir", str(target)])


def _status(conf: str) -> Attempt:
    return lambda target, ctx: cli(ctx, ["status", "--rdzv-endpoint", UNREACHABLE, "--rdzv-id", "job",
                                         f"--rdzv-conf={conf}"])


SECONDS = "give a number from 0.001 to 2592000 (seconds)"
RDZV_CONF = [
    Row("`--rdzv-conf read_timeout=`", "`nan`", f"--rdzv-conf read_timeout='nan' is out of range; {SECONDS}",
        "nothing written", "raises EtcdV3ConfigError", place_itself, rdzv(read_timeout="nan")),
    Row("`--rdzv-conf read_timeout=`", "`inf`", f"--rdzv-conf read_timeout='inf' is out of range; {SECONDS}",
        "nothing written", "raises EtcdV3ConfigError", place_itself, rdzv(read_timeout="inf")),
    Row("`--rdzv-conf outage_timeout=`", "`nan`", "--rdzv-conf outage_timeout='nan' is out of range; give a number "
        "from 0 to 2592000 (seconds)", "nothing written", "raises EtcdV3ConfigError", place_itself,
        rdzv(outage_timeout="nan")),
    Row("`--rdzv-conf keep_alive_interval=`", "`99999999999999999999`",
        "--rdzv-conf keep_alive_interval='99999999999999999999' is out of range; give an integer from 1 to 2592000 "
        "(seconds)", "nothing written", "raises EtcdV3ConfigError", place_itself,
        rdzv(keep_alive_interval="99999999999999999999")),
    Row("`--rdzv-conf peer_probe=`", "`2`", "--rdzv-conf peer_probe='2' is out of range; give 0 or 1",
        "nothing written", "raises EtcdV3ConfigError", place_itself, rdzv(peer_probe="2")),
    Row("`--rdzv-conf`", "an unknown key `bogus=1`", "unknown --rdzv-conf key(s) for etcd-v3: bogus; valid keys: …",
        "nothing written", "raises EtcdV3ConfigError", place_itself, rdzv(bogus="1")),
    Row("`elastic-mnist preflight --rdzv-conf`", "`read_timeout=inf`",
        f"preflight: flags: FAILED: --rdzv-conf read_timeout='inf' is out of range; {SECONDS}",
        "nothing written", "78", place_itself, _preflight("read_timeout=inf")),
    Row("`elastic-mnist status --rdzv-conf`", "`keep_alive_interval=99999999999999999999`",
        "elastic-mnist status: error: --rdzv-conf keep_alive_interval='99999999999999999999' is out of range",
        "nothing written", "2", place_itself, _status("keep_alive_interval=99999999999999999999")),
]


def _backend(ctx, target: Path, run_id: str, secret: bytes | None = SECRET):
    """A node's backend and store for `run_id`; its secret file sits beside the target, not in it."""
    from etcd_fixtures import rdzv_params

    from elastic_mnist.rendezvous import create_backend

    conf = {}
    if secret is not None:
        path = target.parent / f"{run_id}-{secret[:1].decode()}.secret"
        path.write_bytes(secret)
        path.chmod(0o600)
        conf["secret_file"] = str(path)
    return create_backend(rdzv_params(ctx.etcd.endpoint, run_id, **conf))


def _beacon_replay(target: Path, ctx: Ctx) -> Outcome:
    """A, B, C publish beacons; A reports B unreachable, the cut heals, and A's old report is written back."""
    from etcd_fixtures import raw_client

    from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Client, run_key
    from elastic_mnist.etcd.lease import LeaseKeeper
    from elastic_mnist.rendezvous._liveness import PeerLiveness
    from elastic_mnist.rendezvous._partition import losing_side

    client, raw, key = EtcdV3Client(EtcdConnectionSpec.parse(ctx.etcd.endpoint)), raw_client(ctx.etcd), \
        run_key(None, "table-beacons", "probe") + "/A"
    live = {n: PeerLiveness(client, LeaseKeeper(client, 0), None, "table-beacons", SECRET) for n in "ABC"}
    try:
        for name, agent in live.items():
            agent.publish(name)
        live["A"]._note_unreachable({"B"})  # noqa: SLF001 - the cut, as A's probes would find it
        report = raw.get(key)[0]
        live["A"]._note_unreachable(set())  # noqa: SLF001 - healed
        raw.put(key, report)  # the replay, by a writer without the secret
        outcome = warned(ctx, lambda warn: live["C"].read_reports(), lambda _: "A" not in live["C"].reports)
        assert losing_side("ABC", live["C"].reports) == set(), "B is not hidden from rounds"
        live["A"].read_reports()  # A's next look writes its current value again
        assert raw.get(key)[0] != report
        return outcome
    finally:
        for agent in live.values():
            agent.close()
        client.close()


def _store_replay(target: Path, ctx: Ctx) -> Outcome:
    from etcd_fixtures import raw_client

    _, store = _backend(ctx, target, "table-store")
    raw = raw_client(ctx.etcd)
    store.add("counter", 1)
    old = raw.get(store.prefix + "counter")[0]
    store.add("counter", 1)
    raw.put(store.prefix + "counter", old)
    return warned(ctx, lambda warn: store.check(["counter"]), lambda present: present is False)


def _store_planted(target: Path, ctx: Ctx) -> Outcome:
    from etcd_fixtures import raw_client

    _, store = _backend(ctx, target, "table-planted")
    raw_client(ctx.etcd).put(store.prefix + "MASTER_ADDR", b"attacker.example")
    return warned(ctx, lambda warn: store.check(["MASTER_ADDR"]), lambda present: present is False)


def _state_replay(target: Path, ctx: Ctx) -> Outcome:
    from etcd_fixtures import raw_client, state_bits

    from elastic_mnist.rendezvous.etcd_v3 import EtcdV3StateError

    backend, _ = _backend(ctx, target, "table-state")
    raw = raw_client(ctx.etcd)
    _, token, _ = backend.set_state(state_bits(0))
    first = raw.get(backend.key)[0]
    backend.set_state(state_bits(1), token)
    raw.put(backend.key, first)
    return raises(EtcdV3StateError, backend.get_state)


class _Payload:
    """A pickle that, if ever unpickled, creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return open, (str(self.marker), "w")


def _state_pickle(target: Path, ctx: Ctx) -> Outcome:
    from etcd_fixtures import raw_client

    from elastic_mnist.rendezvous.etcd_v3 import EtcdV3StateError

    backend, _ = _backend(ctx, target, "table-pickle", secret=None)
    raw_client(ctx.etcd).put(backend.key, pickle.dumps(_Payload(target / "pwned")))
    outcome = raises(EtcdV3StateError, backend.get_state)
    assert not (target / "pwned").exists(), "nothing of it ran"
    return outcome


def _other_secret(target: Path, ctx: Ctx) -> Outcome:
    from etcd_fixtures import state_bits

    from elastic_mnist.etcd.rdzv_state import StateIntegrityError

    _backend(ctx, target, "table-secrets")[0].set_state(state_bits(0))
    return raises(StateIntegrityError, lambda: _backend(ctx, target, "table-secrets", b"t" * 32))  # another job's


def _other_flags(target: Path, ctx: Ctx) -> Outcome:
    """A node whose --lr differs from the job's, as its agent checks before it joins (it then exits 78 with it)."""
    from elastic_mnist.config import parse_args
    from elastic_mnist.rendezvous import _flags as job_flags

    _, store = _backend(ctx, target, "table-flags")
    job = parse_args([]).fingerprint()
    assert job_flags.refusal(store, job, "table-flags") == "", "the first node defines the job"
    line = job_flags.refusal(store, parse_args(["--lr", "0.5"]).fingerprint(), "table-flags")
    assert job_flags.refusal(store, job, "table-flags") == "", "the job's configuration is as it was"
    return Outcome([line], "78")


REPLAYS = [
    Row("beacon `…/probe/A` (etcd)", "A's sealed \"cannot reach B\" written back after the cut healed",
        "none: every observer ignores it (B stays in rounds) and A writes its value again",
        "A's current beacon, at A's next look", "goes on", place_itself, _beacon_replay, needs="etcd"),
    Row("store `…/store/counter` (etcd)", "an older sealed value of the key written back",
        "elastic-mnist etcd-v3: warning: ignoring the store value under …/counter: it was sealed as version 1 of "
        "the key and etcd holds it as version 3: an older value of this job written back (a replay); waiting "
        "for the genuine value", "the job's next write goes over it", "goes on", place_itself, _store_replay,
        needs="etcd"),
    Row("store `…/store/MASTER_ADDR` (etcd)", "a value planted without the secret",
        "elastic-mnist etcd-v3: warning: ignoring the store value under …/MASTER_ADDR: its HMAC does not verify "
        "with this job's secret", "the genuine value, once written", "goes on", place_itself, _store_planted,
        needs="etcd"),
    Row("state `…/state` (etcd)", "an older sealed state written back",
        "refusing the rendezvous state in …: it was sealed as version 1 of the key … (a replay)",
        "nothing of it used", "raises EtcdV3StateError", place_itself, _state_replay, needs="etcd"),
    Row("state `…/state` (etcd, no secret)", "a pickle that would run code",
        "refusing the rendezvous state in …: it is not torch's rendezvous state (unexpected class …); … Nothing "
        "of it was executed", "nothing ran", "raises EtcdV3StateError", place_itself, _state_pickle, needs="etcd"),
    Row("`--rdzv-conf secret_file=`", "another secret than the job's (etcd)",
        "refusing the rendezvous state in …: its HMAC does not verify with this job's secret",
        "the state", "raises StateIntegrityError", place_itself, _other_secret, needs="etcd"),
    Row("`--lr`, `--seed`, `--hidden`, … (etcd-v3)", "one node started with another value than the job's (a "
        "second node with `--lr 0.5`)", "this node's flags differ from those job … trains with: --lr 0.5 (the job: "
        "0.001); start this node with the job's flags, or another configuration as a new job with a new --rdzv-id "
        "(the job goes on without this node)", "the job's configuration; its running nodes train on", "78",
        place_itself, _other_flags, needs="etcd"),
]


_TRANSFER = """
import os
import sys
import torch.distributed as dist
from elastic_mnist.state import format as checkpoint, sync
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
if rank == 1:
    checkpoint.read_limit = lambda directory=None: 1000  # this rank can hold 1000 bytes
try:
    sync.broadcast_bytes(b"x" * 4096 if rank == 0 else b"", 0)
    print("received")
except sync.TransferRefused as e:
    print(e)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # no interpreter teardown while gloo's threads free the collective's tensors (SIGABRT)
"""


def _transfer(target: Path, ctx: Ctx) -> Outcome:
    """Two real processes in a gloo group: rank 0 announces 4096 bytes to a rank that can hold 1000."""
    store = str(target.parent / "gloo-store")
    ranks = [subprocess.Popen([sys.executable, "-c", _TRANSFER, str(rank), store], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=child_env()) for rank in (0, 1)]
    outs = [rank.communicate(timeout=120)[0].strip() for rank in ranks]
    assert outs[0] == outs[1] and all(rank.returncode == 0 for rank in ranks), outs
    return Outcome(outs[1].splitlines(), "raises TransferRefused, on every rank")


TRANSFER = [
    Row("peer state transfer", "a peer announces a state larger than a receiving rank can hold",
        "rank 0 announced a 4,096-byte state, more than a rank of this group can hold (half its available "
        "memory): free memory on the nodes, or fewer per node", "nothing allocated",
        "raises TransferRefused, on every rank", place_itself, _transfer),
]

