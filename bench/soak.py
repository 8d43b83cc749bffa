"""The soak: hundreds of membership changes on a compressed schedule, and whether anything grows with them.

    python -m bench --soak --data-dir ../shared/data --update-docs      # 500 changes, ~35 min on 2 cores
    python -m bench --soak --soak-changes 60 --out /tmp/soak             # a short one
    python -m bench --soak --soak-parallel fsdp --soak-changes 100 --update-docs   # sharded kept workers

Two long-lived nodes (n0, n1) train throughout under `elastic-mnist local`; a third node joins and leaves
again, again and again: killed, preempted (SIGTERM), and, as root, its host vanished (`--hosts`). Every
kept worker journals what it holds at each round's end (threads, descriptors, sockets, RSS: usage.py); a
sampler reads etcd (keys, revision, database size after a compaction), the agents and warm processes, the
run's /dev/shm, checkpoints and logs. Writes OUT/soak.json and OUT/soak.png; --update-docs puts the table
between `<!-- soak:start -->` and `<!-- soak:end -->` in docs/benchmarks.md. Under --soak-parallel fsdp the
files are soak-fsdp.* and the markers soak-fsdp:start and soak-fsdp:end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from bench import report
from bench.machine import describe, one_line
from bench.runner import REPO, child_env, log, median, python_m
from elastic_mnist.config import TrainConfig
from elastic_mnist.contract.env import NODE_ENV
from elastic_mnist.usage import usage


def name(parallel: str) -> str:
    """The soak's file and marker name: soak (the default, DDP) or soak-PARALLEL."""
    return "soak" if parallel == "ddp" else f"soak-{parallel}"


def markers(parallel: str) -> tuple[str, str]:
    return f"<!-- {name(parallel)}:start -->", f"<!-- {name(parallel)}:end -->"

WARM_UP = 20  # rounds before growth is measured (the warm-up: caches, first compiles)
STEPS_BETWEEN = 24  # steps of training between two changes (at 0.05 s a step)
SAMPLE_S = 2.0
HOLD_LIMIT_S = TrainConfig.collective_timeout + 15.0  # a given-up group's collectives end by the timeout


def schedule(changes: int, hosts: bool, gap: int = STEPS_BETWEEN, first: int = 40) -> str:
    """join, then the joiner leaves (kill, term, vanish in turn), `gap` steps apart: `changes` changes."""
    leave = ["kill", "term", *(["vanish"] if hosts else [])]
    faults, step = [], first
    for i in range((changes + 1) // 2):
        faults.append(f"join@step={step}")
        faults.append(f"{leave[i % len(leave)]}:n{2 + i}@step={step + gap}")
        step += 2 * gap
    return ",".join(faults[:changes])


def measure(out: Path, data_dir: str, changes: int, work: Path, parallel: str = "ddp") -> dict:
    hosts = os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "nft", "unshare"))
    run_dir = work / "soak-run"
    cmd = [*python_m("elastic_mnist"), "local", "--nodes", "2", "--max-nodes", "3", "--chaos", schedule(changes, hosts),
           "--end-after-chaos", "--run-dir", str(run_dir), "--min-step-time", "0.05", "--epochs", "1000",
           "--data-dir", data_dir, "--timeout", str(60 + 12 * changes), *(["--hosts"] if hosts else []),
           "--parallel", parallel]
    vanish = " (vanish: with --hosts)" if hosts else " (no vanish: needs root)"
    log(f"soak ({parallel}): {changes} changes{vanish}; {run_dir}")
    sampler = Sampler(run_dir)
    started = time.time()
    with open(work / "soak-local.log", "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env())
        sampler.start()
        code = proc.wait()
    sampler.stop()
    local = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else {}
    result = summarize(run_dir, local, sampler.samples, sampler.etcd)
    result.update(command=" ".join(cmd), exit_code=code, wall_s=round(time.time() - started, 1), hosts=hosts,
                  changes_scheduled=changes, machine=describe(), parallel=parallel)
    result["targets"] = judge(result)
    return result


class Sampler:
    """Every SAMPLE_S: the long-lived nodes' agents and warm processes and the run's files; etcd (after a
    compaction) from a probe process on etcd's host."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.samples, self.etcd = run_dir, [], []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="soak-sampler")
        self._probe: subprocess.Popen | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(30)
        if self._probe is not None:
            self._probe.kill()
            self._probe.wait()

    def _loop(self) -> None:
        while not self._done.wait(SAMPLE_S):
            if self._probe is None:
                self._probe = _start_probe(self.run_dir, self.etcd)
            self.samples.append({"time": time.time(), **_processes(), **_files(self.run_dir)})


def _start_probe(run_dir: Path, into: list) -> subprocess.Popen | None:
    """`python -m bench.soak ENDPOINT` on etcd's host; its JSON lines go into `into`."""
    try:
        info = json.loads((run_dir / "etcd.json").read_text())
        hosts = json.loads((run_dir / "hosts.json").read_text()) if (run_dir / "hosts.json").exists() else None
    except (OSError, ValueError):
        return None  # not written yet: the next sample tries again
    prefix = ["ip", "netns", "exec", hosts["hosts"]["etcd"]["netns"]] if hosts else []
    proc = subprocess.Popen([*prefix, *python_m("bench.soak"), info["endpoint"]], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=REPO, env=child_env())

    def read() -> None:
        for line in proc.stdout:
            into.append(json.loads(line))

    threading.Thread(target=read, daemon=True, name="soak-etcd-reader").start()
    return proc


def _processes() -> dict:
    """The agents and warm processes of n0 and n1, found by the node name in their environment (with
    --hosts they run behind `ip netns exec`: the pid their launcher knows is not theirs)."""
    out = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        cmd = _cmdline(pid)
        agent, warm = b"torch.distributed.run" in cmd or b"torchrun" in cmd, b"elastic_mnist.warm" in cmd
        kind = "agent" if agent else "warm" if warm else None
        node = _node_of(pid) if kind else None
        if node in ("n0", "n1"):
            out[f"{node}_{kind}"] = usage(pid)
    return out


def _node_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    hit = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(NODE_ENV.encode() + b"=")]
    return hit[0] if hit else None


def probe_etcd(endpoint: str) -> None:
    """Every SAMPLE_S, one JSON line: keys, revision and database size, after compacting to the current
    revision (what the server's auto-compaction does hourly, done here so that any growth shows)."""
    import etcd3

    host, port = endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port), timeout=5)
    while True:
        try:
            # One count-only range over every key: its header carries the store's revision.
            response = client.get_response(b"\0", range_end=b"\0", count_only=True)
            revision = response.header.revision
            client.compact(revision, physical=True)
            line = {"time": time.time(), "etcd_keys": response.count, "etcd_revision": revision,
                    "etcd_db_bytes": client.status().db_size}
        except Exception as e:  # noqa: BLE001 - etcd restarting or gone at the end: the next sample tries
            line = {"time": time.time(), "etcd_error": str(e)[:120]}
        print(json.dumps(line), flush=True)
        time.sleep(SAMPLE_S)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _files(run_dir: Path) -> dict:
    def size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0

    shm = Path("/dev/shm")
    run_id = _run_id(run_dir)
    return {"shm_bytes": sum(size(p) for p in shm.glob(f"elastic-mnist*/{run_id}*")) if run_id else 0,
            "checkpoint_bytes": size(run_dir / "checkpoints"), "log_bytes": size(run_dir / "nodes"),
            "tensorboard_bytes": size(run_dir / "tensorboard")}


def _run_id(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / "etcd.json").read_text())["rdzv_id"]
    except (OSError, ValueError, KeyError):
        return ""


def summarize(run_dir: Path, local: dict, samples: list[dict], etcd: list[dict]) -> dict:
    """Per round of each long-lived node's worker: what it held; the changes' stalls; fresh workers."""
    from elastic_mnist.runlog import read_records

    records = [r for r in read_records(str(run_dir / "tensorboard" / "events")) if r.get("node") in ("n0", "n1")]
    # In time order: a node's records come from several journal files (one per rank it held), read by name.
    rounds = {n: sorted((r for r in records if r["node"] == n and r.get("event") == "round_end"),
                        key=lambda r: r.get("time", 0.0)) for n in ("n0", "n1")}
    workers = {node: sorted({r["pid"] for r in records if r["node"] == node}) for node in ("n0", "n1")}
    fallbacks = [r.get("reason", "") for r in records if r.get("event") == "fallback"]
    events = local.get("events", [])
    stalls = [e["stall_s"] for e in events if e.get("stall_s") is not None]
    return {"rounds": {n: [_round_row(r) for r in rs] for n, rs in rounds.items()}, "workers": workers,
            "fresh_workers": sum(len(p) - 1 for p in workers.values()), "fallbacks": fallbacks,
            "changes": len(events), "stalls_s": stalls, "samples": samples, "etcd": etcd,
            "kinds": sorted({e["kind"] for e in events})}


def _round_row(r: dict) -> dict:
    keys = ("round", "time", "threads", "fds", "sockets", "rss_mb", "given_up", "given_up_oldest_s", "gc_ms", "lost")
    return {k: r.get(k) for k in keys}


def growth(rows: list[dict], key: str) -> dict:
    """From round WARM_UP on, the first window (a fifth of the rounds, at least 5) against the last: the
    floor (what every round keeps: a leak raises it) and the peak. The floor counts only rounds that ended
    holding no given-up round's groups: those are held until their collectives end, within the collective
    timeout (`longest_hold_s` bounds that), and a run may end inside such a hold."""
    rows = [r for r in rows if r["round"] >= WARM_UP and r.get(key) is not None and r[key] >= 0]
    held = [r for r in rows if not r.get("given_up")]
    rows = held if len(held) >= 10 else rows
    if len(rows) < 10:
        return {"rounds": len(rows)}
    w = max(5, len(rows) // 5)
    first, last = [r[key] for r in rows[:w]], [r[key] for r in rows[-w:]]
    return {"rounds": len(rows), "first": min(first), "last": min(last), "growth": round(min(last) - min(first), 1),
            "peak_first": max(first), "peak_last": max(last)}


def longest_hold_s(rows: list[dict]) -> float:
    """The longest a kept worker held one given-up round's groups: the oldest hold's age at each round end. Kills
    closer together than the collective timeout overlap their holds, so without that age (older journals) this
    is the longest run of rounds holding any, in time order; a group whose collectives never end is held to
    the end of the run either way."""
    ages = [r["given_up_oldest_s"] for r in rows if r.get("given_up_oldest_s") is not None]
    if ages:
        return round(max(ages), 1)
    longest, since = 0.0, None
    for r in rows:
        if r.get("given_up") and since is None:
            since = r["time"]
        elif not r.get("given_up") and since is not None:
            longest, since = max(longest, r["time"] - since), None
    return round(max(longest, rows[-1]["time"] - since if since is not None else 0.0), 1)


def rss_per_100(rows: list[dict]) -> float | None:
    """RSS growth per 100 rounds, a least-squares slope from round WARM_UP on."""
    pts = [(r["round"], r["rss_mb"]) for r in rows if r["round"] >= WARM_UP and (r.get("rss_mb") or -1) > 0]
    if len(pts) < 10:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return round(100 * sum((x - mx) * (y - my) for x, y in pts) / den, 2) if den else None


def in_time_order(result: dict) -> dict:
    """The result with each node's rounds in time order (a soak.json written before summarize sorted them)."""
    return {**result, "rounds": {n: sorted(rows, key=lambda r: r.get("time") or 0.0)
                                 for n, rows in result["rounds"].items()}}


def judge(result: dict) -> list[dict]:
    out = []
    for node, rows in result["rounds"].items():
        slope = rss_per_100(rows)
        out.append(_target(f"{node} RSS MB per 100 rounds", slope, "<=", 2.0))
        for key in ("threads", "fds", "sockets"):
            g = growth(rows, key).get("growth")
            out.append(_target(f"{node} {key} growth", g, "<=", 0))
        out.append(_target(f"{node} given-up groups held (s)", longest_hold_s(rows), "<=", HOLD_LIMIT_S))
    keys = [s["etcd_keys"] for s in result["etcd"] if "etcd_keys" in s]
    out.append(_target("etcd keys growth (last sample - sample at a fifth of the run)",
                       keys[-1] - keys[len(keys) // 5] if len(keys) >= 5 else None, "<=", 0))
    stalls = result["stalls_s"]
    first, last = median(stalls[:50]), median(stalls[-50:])
    out.append(_target("stall p50, last 50 / first 50", round(last / first, 2) if first and last else None, "<=", 1.2))
    out.append(_target("changes that started a fresh worker", result["fresh_workers"], "<=", 0))
    return out


def _target(what: str, value, op: str, threshold) -> dict:
    met = None if value is None else (value <= threshold)
    return {"id": what, "description": what, "value": value, "op": op, "threshold": threshold, "met": met,
            "detail": ""}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for (ax, key, unit) in zip(axes.flat[:3], ("rss_mb", "threads", "fds"), ("MB", "", "")):
        for node, rows in result["rounds"].items():
            ax.plot([r["round"] for r in rows], [r[key] for r in rows], label=f"{node}'s worker", lw=1)
        ax.set(xlabel="round of the kept worker", ylabel=f"{key} {unit}".strip())
        ax.legend(fontsize=8)
    t0 = result["etcd"][0]["time"] if result["etcd"] else 0
    pts = [(s["time"] - t0, s["etcd_db_bytes"] / 1e6) for s in result["etcd"] if "etcd_db_bytes" in s]
    axes.flat[3].plot([p[0] for p in pts], [p[1] for p in pts], lw=1)
    axes.flat[3].set(xlabel="seconds", ylabel="etcd database MB (after compaction)")
    fig.suptitle(f"soak: {result['changes']} membership changes (--parallel {result.get('parallel', 'ddp')})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def render(result: dict) -> str:
    stalls = result["stalls_s"]
    lines = [f"Measured {result['finished_at']} ({result['wall_s']:.0f} s) on: {one_line(result['machine'])}. "
             f"Tree: {result['provenance']['describe']}.", "",
             f"{result['changes']} changes ({', '.join(result['kinds'])}), 2 long-lived nodes, --parallel "
             f"{result.get('parallel', 'ddp')}; stall p50 "
             f"{median(stalls[:50])} s (first 50), {median(stalls[-50:])} s (last 50); fresh workers on the "
             f"long-lived nodes: {result['fresh_workers']}; fallbacks: {len(result['fallbacks'])}.", "",
             "| node | rounds | RSS MB (round 20 → last) | MB per 100 rounds | threads (first → last window) | "
             "fds | sockets |", "|---|---|---|---|---|---|---|"]
    for node, rows in result["rounds"].items():
        late = [r for r in rows if r["round"] >= WARM_UP]
        rss = f"{late[0]['rss_mb']} → {late[-1]['rss_mb']}" if late else "-"
        cells = [_window(growth(rows, k)) for k in ("threads", "fds", "sockets")]
        lines.append(f"| {node} | {len(rows)} | {rss} | {rss_per_100(rows)} | {' | '.join(cells)} |")
    etcd = [s for s in result["etcd"] if "etcd_keys" in s]
    if etcd:
        lines += ["", f"etcd: {etcd[0]['etcd_keys']} → {etcd[-1]['etcd_keys']} keys, revision "
                  f"{etcd[-1]['etcd_revision']}, database {etcd[0]['etcd_db_bytes'] / 1e6:.1f} → "
                  f"{etcd[-1]['etcd_db_bytes'] / 1e6:.1f} MB "
                  "after compaction."]
    own = name(result.get("parallel", "ddp"))
    lines += ["", f"![soak](../bench/results/{own}.png)", "", *report.targets_md(result), ""]
    return f"<!-- generated by `python -m bench --soak` from {own}.json; do not edit -->\n" + "\n".join(lines)


def _window(g: dict) -> str:
    return f"{g['first']} → {g['last']}" if "first" in g else "-"


def write(result: dict, out: Path, docs: Path | None) -> bool:
    out.mkdir(parents=True, exist_ok=True)
    parallel = result.get("parallel", "ddp")
    own = name(parallel)
    plot(result, out / f"{own}.png")
    (out / f"{own}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{own}.md").write_text(render(result))
    return docs is None or report.update_between_markers(docs, render(result), *markers(parallel))


if __name__ == "__main__":
    import sys

    probe_etcd(sys.argv[1])
