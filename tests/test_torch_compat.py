"""torch's private API is reached only through elastic_mnist/compat/private.py, whose checks pass here and
fail with one clear line where torch moved something.

    python -m pytest tests/test_torch_compat.py -q
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO, worker_env

from elastic_mnist.compat import private as compat
from elastic_mnist.etcd.rdzv_state import ALLOWED_CLASSES, NodeDesc

PACKAGE = REPO / "elastic_mnist"
# Private attributes of torch objects we reach (the handler, its executor and state holder): on anything
# but `self` or `super()` (a subclass of torch's using what it inherits), that is reaching into torch.
TORCH_PRIVATE_ATTRS = {"_this_node", "_settings", "_state_holder", "_op_executor", "_stop_heartbeats",
                       "_backend", "_state", "_node", "_remove_from_participants"}
# Names torch reads or dispatches to that our code would otherwise spell out.
TORCH_PRIVATE_STRINGS = {compat.DISABLE_SHARED_STORE_ENV, *compat.CPP_STORE_NAMES}
# Key names and paths of torch's own that code would otherwise spell out, found inside any string but prose.
TORCH_PRIVATE_KEYS = (compat.ROUND_PREFIX, compat.exit_barrier_key().rsplit("/", 1)[0])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_torch(module: str | None) -> bool:
    return module is not None and (module == "torch" or module.startswith("torch."))


def _own(node: ast.AST) -> bool:
    """`self` or `super()`: a subclass of torch's using what it inherits (checked by compat/private.py)."""
    if isinstance(node, ast.Call):
        node = node.func
        return isinstance(node, ast.Name) and node.id == "super"
    return isinstance(node, ast.Name) and node.id == "self"


def _chain(node: ast.AST) -> list[str] | None:
    """`a.b._c` -> ["a", "b", "_c"]; None unless the chain starts at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _torch_aliases(tree: ast.AST) -> set[str]:
    """Local names bound to torch modules or objects (`import torch.distributed as dist`, `from torch import nn`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if _is_torch(a.name)}
        elif isinstance(node, ast.ImportFrom) and _is_torch(node.module):
            names |= {a.asname or a.name for a in node.names}
    return names


def violations(source: str) -> list[str]:
    """Every use of a private torch name in `source`, as 'line: what'."""
    tree, found = ast.parse(source), []
    aliases = _torch_aliases(tree)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names
                      if _is_torch(a.name) and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and _is_torch(node.module):
            found += [f"{line}: from {node.module} import {a.name}" for a in node.names
                      if _private(a.name) or any(map(_private, node.module.split(".")))]
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in aliases and _private(node.attr):
                found.append(f"{line}: {'.'.join(chain)}")
            elif node.attr in TORCH_PRIVATE_ATTRS and not _own(node.value):
                found.append(f"{line}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and node.value in TORCH_PRIVATE_STRINGS:
            found.append(f"{line}: {node.value!r}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
              and any(key in node.value for key in TORCH_PRIVATE_KEYS)):
            found.append(f"{line}: {node.value!r}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in TORCH_PRIVATE_STRINGS:
            found.append(f"{line}: def {node.name}")
    return found


def test_only_the_compat_module_reaches_torch_private_names():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() != "compat/private.py" and (bad := violations(path.read_text())):
            found[str(path.relative_to(REPO))] = bad
    assert not found, f"private torch names outside elastic_mnist/compat/private.py: {found}"


def test_the_rule_catches_what_the_package_did_before():
    # Lines as they were before compat/private.py (each one of the kinds the rule covers).
    before = textwrap.dedent("""
        import torch
        import torch.distributed as dist
        import torch._dynamo
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, _Action
        from torch._C import _distributed_c10d
        store = dist.distributed_c10d._get_default_store()
        dist.distributed_c10d._abort_process_group()
        torch._foreach_copy_(a, b)
        handler._state_holder = holder
        handler._op_executor.run(op, deadline)
        handler._stop_heartbeats()
        print(handler._this_node, handler._state_holder._backend.client)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        class S(Store):
            def getNumKeys(self): ...
        EXIT_BARRIER_KEY = "torchelastic/agent/terminal_state/last_member"
        store.delete_key(f"torch.rendezvous.{run_id}.{round_}/{EXIT_BARRIER_KEY}")
        \"\"\"A docstring may tell of torch.rendezvous.<run_id>.<round>/torchelastic/agent/terminal_state.\"\"\"
    """)
    lines = {int(v.split(":")[0]) for v in violations(before)}
    assert lines == set(range(4, 19)) - {15}, violations(before)


def test_the_rule_allows_our_own_private_names():
    allowed = textwrap.dedent("""
        import torch
        from elastic_mnist.compat import private as compat
        from elastic_mnist.compat.private import Action
        from elastic_mnist.etcd.rdzv_state import ALLOWED_CLASSES
        print(torch.__version__, compat.handler_node(handler), self._state_holder.sync(), self._state)
        super()._remove_from_participants()
        self._dead = {}
        client._secret = None
    """)
    assert violations(allowed) == []


def test_a_missing_field_is_one_clear_line():
    @dataclasses.dataclass
    class _RendezvousState:
        round: int = 0
        participants: dict = dataclasses.field(default_factory=dict)

    with pytest.raises(compat.TorchCompatError) as err:
        compat.require_fields(_RendezvousState, ("round", "participants", "last_heartbeats"))
    assert str(err.value) == (f"elastic-mnist needs torch's dynamic rendezvous internals: torch {torch.__version__} "
                              "has no field _RendezvousState.last_heartbeats; supported: torch 2.13-2.14")


def test_a_stand_in_field_torch_lacks_fails_the_pickled_classes_check():
    @dataclasses.dataclass(frozen=True)
    class Node(NodeDesc):
        rack: str = ""

    key = ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc")
    with pytest.raises(compat.TorchCompatError, match=r"has no field _NodeDesc\.rack; supported"):
        compat.check_pickled_classes({**ALLOWED_CLASSES, key: Node})
    moved = {("torch.distributed.elastic.rendezvous.moved", "_NodeDesc"): NodeDesc}
    with pytest.raises(compat.TorchCompatError, match="pickles no torch.distributed.elastic.rendezvous.moved"):
        compat.check_pickled_classes(moved)


def test_signature_and_attribute_mismatches_are_one_line():
    def run(self, handler, deadline): ...

    with pytest.raises(compat.TorchCompatError) as err:
        compat.require_params(run, ("self", "state_handler", "deadline"), "X.run")
    assert "has X.run(self, handler, deadline), not (self, state_handler, deadline, ...)" in str(err.value)
    with pytest.raises(compat.TorchCompatError, match=r"has no .*\._not_there;"):
        compat.require(compat, "_not_there")
    assert "\n" not in str(err.value)


def test_abort_without_torch_support_is_a_no_op_said_once(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_abort", None)
    monkeypatch.setattr(compat, "_abort_missing_said", False)
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        assert compat.abort_process_group() is False
        assert compat.abort_process_group() is False
    assert [r.getMessage() for r in caplog.records if "_abort_process_group" in r.getMessage()] == [
        f"torch {torch.__version__} has no _abort_process_group: a collective blocked on a lost peer waits for "
        "its timeout"]


def test_the_checks_pass_on_the_installed_torch(capsys):
    compat.main()
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"OK: torch {torch.__version__}")
    for name in ("_RendezvousState.last_heartbeats (field)", "torch._foreach_copy_",
                 "Store trampoline -> getNumKeys, deleteKey", "DynamicRendezvousHandler uses _op_executor"):
        assert name in out


def test_importing_it_stays_cheap():
    """Workers import it: no torch._dynamo, no etcd client, and torch's rendezvous only on first use."""
    code = ("import sys, elastic_mnist.compat.private as c; a = set(sys.modules); c.Action; "
            "print(sorted(m for m in ('torch._dynamo', 'etcd3', 'grpc', "
            "'torch.distributed.elastic.rendezvous.dynamic_rendezvous') if m in a), "
            "'torch.distributed.elastic.rendezvous.dynamic_rendezvous' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=worker_env(), cwd=REPO,
                         timeout=120)
    assert out.stdout.split() == ["[]", "True"], out.stdout + out.stderr


def test_the_store_gets_the_cpp_names():
    from elastic_mnist.rendezvous.store import EtcdV3Store

    assert EtcdV3Store.getNumKeys is EtcdV3Store.num_keys and EtcdV3Store.deleteKey is EtcdV3Store.delete_key


def test_event_names_are_torch_s_without_inspect_stack(monkeypatch):
    """The frame-based name is the one torch's inspect.stack() gives, at every depth."""
    dyn = compat._rendezvous()
    monkeypatch.setattr(dyn, "get_method_name", dyn.get_method_name)  # put back after the test
    # torch's own function from a fresh copy of its module: an earlier test in this process may have made a
    # handler, which already swapped the name in
    spec = importlib.util.find_spec(dyn.__name__)
    pristine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pristine)
    original = pristine.get_method_name
    dyn.get_method_name = original

    def _record():  # as torch's _record calls it: the name of the method that records
        return dyn.get_method_name(), dyn.get_method_name(depth=1), dyn.get_method_name(depth=100_000)

    def next_rendezvous():
        return _record()

    expected = next_rendezvous()
    compat.quick_event_names()
    assert dyn.get_method_name is compat._method_name
    assert next_rendezvous() == expected == ("next_rendezvous", "_record", "no_method_name")
