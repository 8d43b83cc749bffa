"""What a stand-in's start costs in CPU: at every membership change each node's agent starts a new Python
process (the stand-in) that imports the hand-over path and passes its command to the kept worker, so at 8
nodes on 2 cores eight of them run at once inside the stall.

    python -m bench.stand_in                              # this tree against a bare interpreter
    python -m bench.stand_in --against ../old-checkout    # and another tree, interleaved in the same run
    python -m bench.stand_in --against ../old --out bench/results/stand_in.json

Each run is one `python -c` of the stand-in's imports; its CPU (user + system, from wait4) is compared with a
bare `python -c pass` measured between them, so the machine's drift hits both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from bench import machine

STAND_IN = "from elastic_mnist.warm import handoff; from elastic_mnist.worker.stop import install_early"


def cpu_ms(code: str, tree: str | None) -> float:
    """User + system CPU milliseconds of one `python -c code`, with `tree` first on the path."""
    env = dict(os.environ, PYTHONPATH=tree) if tree else dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tree or None)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"`{code}` exited {proc.returncode} in {tree or 'this tree'}")
    return (usage.ru_utime + usage.ru_stime) * 1000


def commit_of(tree: str) -> str:
    """The tree's checked-out commit and whether its package has uncommitted changes (what was measured)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True, check=False).stdout.strip()

    changed = git("status", "--porcelain", "elastic_mnist")
    return git("rev-parse", "--short=10", "HEAD") + (" + changes" if changed else "")


def summary(samples: list[float]) -> dict:
    q = statistics.quantiles(samples, n=4)
    return {"median_ms": round(statistics.median(samples), 1), "p25_ms": round(q[0], 1),
            "p75_ms": round(q[2], 1), "runs": len(samples)}


def measure(runs: int, trees: dict[str, str | None]) -> dict:
    """Every tree's stand-in imports and a bare interpreter, interleaved `runs` times."""
    samples = {"bare": [], **{name: [] for name in trees}}
    for i in range(runs):
        samples["bare"].append(cpu_ms("pass", None))
        for name, tree in trees.items():
            samples[name].append(cpu_ms(STAND_IN, tree))
        if (i + 1) % 20 == 0:
            print(f"stand-in imports: {i + 1}/{runs} runs", file=sys.stderr, flush=True)
    out = {name: summary(s) for name, s in samples.items()}
    for name in trees:
        out[name]["over_bare_ms"] = round(out[name]["median_ms"] - out["bare"]["median_ms"], 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stand_in", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=80, help="interleaved runs of each")
    parser.add_argument("--against", help="another checkout's root, measured in the same run")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": here, **({"against": os.path.abspath(args.against)} if args.against else {})}
    machine.emit({"code": STAND_IN, "trees": {k: commit_of(t) for k, t in trees.items()},
                  "cpu": measure(args.runs, trees)}, args.out)


if __name__ == "__main__":
    main()
