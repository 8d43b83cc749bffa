"""torch's handler reshaped in one place: the layers wrap in policy.ORDER, and a node that ends alone leaves the
rendezvous open.

    python -m pytest tests/test_agent_policy.py -q
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from elastic_mnist.rendezvous.policy import ORDER, AgentPolicy


def _handler(calls):
    return SimpleNamespace(next_rendezvous=lambda: calls.append("torch") or "info", num_nodes_waiting=lambda: 0,
                           shutdown=lambda: calls.append("closed") or True, set_closed=lambda: calls.append("closed"))


def _tracing(name, calls):
    def layer(inner, policy):
        return replace(inner, next_rendezvous=lambda: calls.append(name) or inner.next_rendezvous())
    return layer


def test_the_layers_wrap_in_order_innermost_first():
    calls = []
    handler = _handler(calls)
    policy = AgentPolicy(handler)
    for name in ORDER:
        policy.add(name, _tracing(name, calls))
    policy.install()
    assert handler.next_rendezvous() == "info"
    assert calls == [*reversed(ORDER), "torch"], "the last layer is the outermost"


def test_a_layer_out_of_order_is_refused():
    policy = AgentPolicy(_handler([])).add("verdict", _tracing("verdict", []))
    with pytest.raises(ValueError, match="the order is"):
        policy.add("shrink", _tracing("shrink", []))


def test_a_node_that_ends_alone_does_not_close_the_rendezvous(capsys):
    calls = []
    handler = _handler(calls)
    policy = AgentPolicy(handler)
    policy.install()
    with pytest.raises(SystemExit) as ended:
        policy.end_this_node("elastic-mnist etcd-v3: error: the disk is full", 69, "this node ends")
    assert ended.value.code == 69 and handler.shutdown() is True
    assert calls == [], "torch's shutdown (which closes the rendezvous for every node) was not called"
    assert capsys.readouterr().err == "elastic-mnist etcd-v3: error: the disk is full; this node ends\n"
