"""The house by concern: every import inside the package runs downward, from the public face through the
operator tools and the worker to the base, never back up (lazy imports inside functions included), and no
modules import each other in a circle, inside a folder either."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "elastic_mnist"

# Floors, top to bottom: a module may import its own room and any room on a lower floor.
FLOORS = [
    {"__init__", "__main__"},
    {"cli", "train", "task"},  # the public face: `elastic-mnist`, `-m elastic_mnist.train`, `Task`
    {"local", "ops"},  # the launcher; the pod entry, preflight and status
    {"worker"},  # the step loop
    {"state", "data", "rendezvous"},  # what survives restarts; the data; the etcd-v3 backend
    {"etcd"},  # the etcd client, its failures, lease, secrets and accounts; the embedded server (no torch)
    # warm: workers forked from a warm process; job_secret reads its file through files.read_regular
    {"config", "distributed", "metrics", "warm", "job_secret"},
    {"agent_link"},  # what an agent and its workers share: torchrun's child (a stand-in or a worker) ends there
    {"runlog", "procs", "files", "netprobe", "compat", "graveyard", "usage"},  # compat: torch reshaped
    {"volume"},  # a full or read-only log or checkpoint volume: what the journal and the writers share
    {"contract"},  # what the processes share: environment variables, exit codes, user errors (stdlib only)
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every elastic_mnist module this file imports, `from elastic_mnist import x` as x."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "elastic_mnist":
            found += [(node.lineno, f"elastic_mnist.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("elastic_mnist."):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("elastic_mnist.")]
    return found


def upward_imports(package: Path = PACKAGE) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        here = room_of(".".join(rel.parts))
        for line, module in imports(path):
            there = room_of(module)
            assert there in FLOOR, f"{module} (imported by {rel}) is in no floor: add its room to FLOORS"
            if there != here and FLOOR[there] <= FLOOR[here]:
                bad.append(f"{rel}.py:{line} ({here}, floor {FLOOR[here]}) imports {module} (floor {FLOOR[there]})")
    return bad


def test_every_room_is_on_a_floor():
    rooms = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert rooms == set(FLOOR), f"unplaced: {rooms - set(FLOOR)}, gone: {set(FLOOR) - rooms}"


def test_the_package_root_holds_at_most_15_modules():
    """The root is for what every process shares; the rest lives in a folder named for its process or base."""
    root = sorted(p.name for p in PACKAGE.glob("*.py") if not p.name.startswith("__"))
    assert len(root) <= 15, root


def test_every_import_runs_downward():
    assert upward_imports() == []


def test_an_upward_import_is_found(tmp_path):
    pkg = tmp_path / "elastic_mnist"
    (pkg / "state").mkdir(parents=True)
    (pkg / "config.py").write_text("def f():\n    from elastic_mnist.state.manager import CheckpointManager\n")
    (pkg / "state" / "manager.py").write_text("from elastic_mnist import config, worker\n")
    assert upward_imports(pkg) == [
        "elastic_mnist/config.py:2 (config, floor 6) imports elastic_mnist.state.manager (floor 4)",
        "elastic_mnist/state/manager.py:1 (state, floor 4) imports elastic_mnist.worker (floor 3)",
    ]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports: at the top, under TYPE_CHECKING or inside a function alike
    (`from elastic_mnist.x import y` counts as importing x.y where y is a module, else x)."""
    names = {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in package.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package.name):
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in names}
        graph[name] = (found & names.keys()) - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_circle_of_imports_anywhere():
    assert circles(import_graph()) == []


def test_a_circle_through_a_type_checking_or_a_lazy_import_is_found(tmp_path):
    pkg = tmp_path / "elastic_mnist"
    (pkg / "rdzv").mkdir(parents=True)
    (pkg / "rdzv" / "a.py").write_text("from elastic_mnist.rdzv import b\n")
    (pkg / "rdzv" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from elastic_mnist.rdzv.c import X\n")
    (pkg / "rdzv" / "c.py").write_text("def f():\n    import elastic_mnist.rdzv.a\n")
    (pkg / "rdzv" / "d.py").write_text("from elastic_mnist.rdzv import a\n")
    assert circles(import_graph(pkg)) == [["elastic_mnist.rdzv.a", "elastic_mnist.rdzv.b", "elastic_mnist.rdzv.c"]]


# Rule of the house by process: a process's folder imports another process's only through contract/ (or a
# shared base: compat, etcd, state, data). A module named in a string (`-m elastic_mnist.x`, a preload)
# counts as an import.
PROCESSES = {"rendezvous", "warm", "worker", "ops", "local"}  # the agent, warm process, worker, operator, launcher


def named_modules(path: Path, names: set[str]) -> set[str]:
    """The package's modules that a file names in a string (a `-m` target, a preload, a lazy export)."""
    return {n.value for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names}


def process_crossings(package: Path = PACKAGE) -> set[str]:
    graph = import_graph(package)
    for name in graph:
        path = package.parent.joinpath(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if room_of(name) != "contract":  # contract names the modules a process starts: that is the contract
            graph[name] |= named_modules(path, set(graph)) - {name}
    return {f"{a} -> {b}" for a, bs in graph.items() for b in bs
            if room_of(a) != room_of(b) and room_of(b) in PROCESSES and room_of(a) not in {"__init__", "__main__",
                                                                                         "cli", "train", "task"}}


def test_a_process_imports_another_only_through_contract():
    assert process_crossings() == set()


def test_a_crossing_by_import_or_by_name_is_found(tmp_path):
    pkg = tmp_path / "elastic_mnist"
    for folder in ("warm", "worker", "etcd"):
        (pkg / folder).mkdir(parents=True)
    (pkg / "worker" / "train.py").write_text("")
    (pkg / "warm" / "plan.py").write_text('PRELOAD = ("elastic_mnist.worker.train",)\n')
    (pkg / "etcd" / "client.py").write_text("def f():\n    from elastic_mnist.warm import plan\n")
    assert process_crossings(pkg) == {"elastic_mnist.warm.plan -> elastic_mnist.worker.train",
                                      "elastic_mnist.etcd.client -> elastic_mnist.warm.plan"}


def torch_attribute_assignments(package: Path = PACKAGE) -> list[str]:
    """Every assignment to an attribute of torch's rendezvous handler (any name torch's handler class or
    instance has) or of a torch module, outside rendezvous/policy.py and compat/ (`self.x = ...` of our own
    subclasses aside)."""
    from elastic_mnist.compat import private as compat

    names = {n for n in dir(compat.DynamicRendezvousHandler) if not n.startswith("__")} | set(compat._HANDLER_ATTRS)
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel == "rendezvous/policy.py" or rel.startswith("compat/"):
            continue
        tree = ast.parse(path.read_text())
        torch_names = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                       for a in n.names if a.name.split(".")[0] == "torch"}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in (e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])):
                if not isinstance(target, ast.Attribute) or getattr(target.value, "id", "") in ("self", "cls"):
                    continue
                root = target.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if target.attr in names or getattr(root, "id", "") in torch_names:
                    found.append(f"{package.name}/{rel}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_torch_objects_are_reshaped_in_the_agent_policy_and_compat_only():
    assert torch_attribute_assignments() == []


def test_a_handler_reshaped_elsewhere_is_found(tmp_path):
    (tmp_path / "elastic_mnist" / "rendezvous").mkdir(parents=True)
    (tmp_path / "elastic_mnist" / "rendezvous" / "_x.py").write_text(
        "import torch.distributed as dist\ndef f(handler, w):\n    handler.next_rendezvous = w.next_rendezvous\n"
        "    dist.barrier = None\n    self.next_rendezvous = w\n")
    assert torch_attribute_assignments(tmp_path / "elastic_mnist") == [
        "elastic_mnist/rendezvous/_x.py:3: handler.next_rendezvous", "elastic_mnist/rendezvous/_x.py:4: dist.barrier"]


def key_names_spelled(package: Path = PACKAGE) -> list[str]:
    """Every string outside contract/ that spells one of contract/keys.py's distinctive key names, and every
    run_key call whose leaf is a literal rather than one of its leaves."""
    from elastic_mnist.contract import keys

    names = [v for k, v in vars(keys).items() if k.endswith(("_KEY", "_PREFIX")) and isinstance(v, str) and "/" in v]
    found = []
    for path in sorted(package.rglob("*.py")):
        if "contract" in path.relative_to(package).parts:
            continue
        tree = ast.parse(path.read_text())
        prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        where = f"{path.relative_to(package.parent)}"
        found += [f"{where}:{n.lineno}: {n.value!r}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and id(n) not in prose and any(name in n.value for name in names)]
        found += [f"{where}:{n.lineno}: run_key(..., {n.args[2].value!r})" for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "run_key" and len(n.args) > 2
                  and isinstance(n.args[2], ast.Constant)]
    return found


def test_our_etcd_and_store_keys_are_named_in_contract_only():
    assert key_names_spelled() == []


def test_a_key_spelled_outside_contract_is_found(tmp_path):
    (tmp_path / "elastic_mnist").mkdir()
    (tmp_path / "elastic_mnist" / "a.py").write_text(
        'X = f"elastic-mnist/control/{t}/agree"\nk = run_key(None, "job", "state")\n')
    assert key_names_spelled(tmp_path / "elastic_mnist") == [
        "elastic_mnist/a.py:1: 'elastic-mnist/control/'", "elastic_mnist/a.py:2: run_key(..., 'state')"]


MUTATORS = {"append", "extend", "add", "update", "pop", "popitem", "clear", "setdefault", "insert", "remove",
            "discard", "appendleft", "set"}


def module_state_in_worker(package: Path = PACKAGE) -> list[str]:
    """What makes a module of worker/ hold state of its own: a `global` statement, or a name bound at module
    level that its functions change (a mutating method, an item or attribute assigned)."""
    found = []
    for path in sorted((package / "worker").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        where = f"{path.relative_to(package.parent)}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found += [f"{where}:{node.lineno}: global {n}" for n in node.names]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                  and getattr(node.func.value, "id", None) in names):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node.func)}()")
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, (ast.Subscript, ast.Attribute)) and getattr(t.value, "id", None) in names:
                        found.append(f"{where}:{node.lineno}: {ast.unparse(t)} =")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_no_module_of_the_worker_holds_state_of_its_own():
    assert module_state_in_worker() == []


def test_module_state_in_the_worker_is_found(tmp_path):
    (tmp_path / "elastic_mnist" / "worker").mkdir(parents=True)
    (tmp_path / "elastic_mnist" / "worker" / "stop.py").write_text(
        "_EARLY = None\n_SEEN = []\nLIMITS = {'a': 1}\ndef f():\n    global _EARLY\n    _EARLY = 1\n"
        "    _SEEN.append(1)\n    LIMITS['b'] = 2\n    return LIMITS.get('a')\n")
    assert module_state_in_worker(tmp_path / "elastic_mnist") == [
        "elastic_mnist/worker/stop.py:5: global _EARLY", "elastic_mnist/worker/stop.py:7: _SEEN.append()",
        "elastic_mnist/worker/stop.py:8: LIMITS['b'] ="]


def env_names_spelled(package: Path = PACKAGE) -> list[str]:
    """Every string outside contract/ that is, or begins with, one of our environment variables' names (prose
    that mentions one, such as a message's `$ELASTIC_MNIST_DATA_DIR`, is for people and may)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if "contract" in path.relative_to(package).parts:
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef,
                ast.FunctionDef, ast.AsyncFunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
        found += [f"{path.relative_to(package.parent)}:{n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("ELASTIC_MNIST_")
                  and id(n) not in docs]
    return found


def test_our_environment_variables_are_named_in_contract_only():
    assert env_names_spelled() == []


def test_a_variable_spelled_outside_contract_is_found(tmp_path):
    (tmp_path / "elastic_mnist" / "contract").mkdir(parents=True)
    (tmp_path / "elastic_mnist" / "contract" / "env.py").write_text('NODE_ENV = "ELASTIC_MNIST_NODE"\n')
    (tmp_path / "elastic_mnist" / "a.py").write_text('"""Reads ELASTIC_MNIST_NODE."""\nX = "set $ELASTIC_MNIST_X"\n'
                                                     'Y = f"{X}ELASTIC_MNIST_Y"\nZ = ("A", "ELASTIC_MNIST_")\n')
    assert env_names_spelled(tmp_path / "elastic_mnist") == ["elastic_mnist/a.py:3", "elastic_mnist/a.py:4"]


def warm_messages_by_hand(package: Path = PACKAGE) -> list[str]:
    """The warm wire read or written as dicts outside contract/warm.py: in warm/, a dict keyed by a message's kind
    or a kind looked up (x["end"], x.get("end"), "end" in x); anywhere, a request built by hand (a dict with
    three or more of its fields)."""
    from elastic_mnist.contract import warm

    kinds, request = set(warm.MESSAGE_KINDS), set(warm.Request.FIELDS)

    def key(node) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    found = []
    for path in sorted(package.rglob("*.py")):
        if "contract" in path.relative_to(package).parts:
            continue
        in_warm, where = path.relative_to(package).parts[0] == "warm", f"{path.relative_to(package.parent)}"
        for n in ast.walk(ast.parse(path.read_text())):
            keys = [key(k) for k in n.keys] if isinstance(n, ast.Dict) else []
            looked = (key(n.slice) if isinstance(n, ast.Subscript) else key(n.args[0]) if isinstance(n, ast.Call)
                      and getattr(n.func, "attr", "") == "get" and n.args else key(n.left) if isinstance(n, ast.Compare)
                      and isinstance(n.ops[0], ast.In) else None)
            if len(request.intersection(keys)) >= 3:
                found.append(f"{where}:{n.lineno}: a request built by hand")
            elif in_warm and (kinds.intersection(keys) or looked in kinds):
                found.append(f"{where}:{n.lineno}: {ast.unparse(n)[:60]}")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_the_warm_wire_is_typed_in_contract_only():
    assert warm_messages_by_hand() == []


def test_a_message_or_request_by_hand_is_found(tmp_path):
    (tmp_path / "elastic_mnist" / "warm").mkdir(parents=True)
    (tmp_path / "elastic_mnist" / "warm" / "a.py").write_text(
        'send({"detach": 0})\nif "end" in m:\n    m.get("refused")\nx = m["pid"]\nrecord = {"pid": 1}.get("rank")\n')
    (tmp_path / "elastic_mnist" / "b.py").write_text('r = {"exe": 1, "argv": [], "cwd": "/"}\nrecord = {"pid": 1}\n')
    assert warm_messages_by_hand(tmp_path / "elastic_mnist") == [
        "elastic_mnist/b.py:1: a request built by hand", "elastic_mnist/warm/a.py:1: {'detach': 0}",
        "elastic_mnist/warm/a.py:2: 'end' in m", "elastic_mnist/warm/a.py:3: m.get('refused')",
        "elastic_mnist/warm/a.py:4: m['pid']", "elastic_mnist/warm/a.py:5: {'pid': 1}"]


def _climbs(run) -> dict[tuple[str, str], int]:
    """Every call, while run() runs, from a function of the package into one of a room on a higher floor (a
    callback or an object handed down): (caller, callee) -> calls. Torch's frames in between are skipped."""
    import sys

    def module(code) -> str | None:
        path = Path(code.co_filename)
        return None if PACKAGE not in path.parents else ".".join(("elastic_mnist", *path.relative_to(PACKAGE)
                                                                         .with_suffix("").parts))

    found: dict[tuple[str, str], int] = {}

    def profile(frame, event, arg):
        callee = module(frame.f_code) if event == "call" else None
        caller = frame.f_back
        while callee and caller is not None and module(caller.f_code) is None:
            caller = caller.f_back
        if callee and caller is not None and FLOOR[room_of(callee)] < FLOOR[room_of(module(caller.f_code))]:
            key = (f"{module(caller.f_code)}.{caller.f_code.co_name}", f"{callee}.{frame.f_code.co_name}")
            found[key] = found.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return found


def test_a_resume_climbs_back_up_a_floor_at_most_5_times(tmp_path):
    """Following config from build_trainer through a resume, a reader goes back up a floor only where an object
    handed down is called (the state registry's objects, a writer's callback): at most 5 such places."""
    import torch
    from trainers import in_process_trainer

    from elastic_mnist.config import TrainConfig
    from elastic_mnist.data.mnist import Split

    gen = torch.Generator().manual_seed(0)
    data = [Split(torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen)) for n in (320, 64)]
    config = TrainConfig(global_batch_size=32, max_steps=5, checkpoint_every=5, checkpoint_dir=str(tmp_path / "c"),
                         log_dir=str(tmp_path / "runs"), snapshot_dir="")
    in_process_trainer(config, *data).train()
    resumed = []
    climbs = _climbs(lambda: resumed.append(in_process_trainer(config, *data)))
    assert resumed[0].progress.step == 5, "it resumed"
    assert 0 < len(climbs) <= 5, "\n".join(f"{a} -> {b} ({n})" for (a, b), n in sorted(climbs.items()))
