"""Which side of a partial partition goes on (rendezvous/_partition.py): the rule every agent applies alike
to the reports it reads from the beacons.

    python -m pytest -q tests/test_partition.py
"""

from __future__ import annotations

from elastic_mnist.rendezvous._partition import EXACT_UP_TO, decode, encode, losing_side


def test_no_report_no_partition() -> None:
    assert losing_side({"a", "b", "c"}, {}) == set()
    assert losing_side({"a", "b"}, {"a": frozenset(), "b": frozenset()}) == set()


def test_two_nodes_cut_the_lowest_name_goes_on_whoever_reported() -> None:
    assert losing_side({"n0", "n1"}, {"n0": {"n1"}}) == {"n1"}
    assert losing_side({"n0", "n1"}, {"n1": {"n0"}}) == {"n1"}, "one report is enough, from either end"
    assert losing_side({"n0", "n1"}, {"n0": {"n1"}, "n1": {"n0"}}) == {"n1"}


def test_the_larger_side_goes_on() -> None:
    # n0 is cut from both others: the two that reach each other go on, although n0 has the lowest name
    assert losing_side({"n0", "n1", "n2"}, {"n1": {"n0"}, "n2": {"n0"}}) == {"n0"}
    # four nodes split 3 / 1
    assert losing_side({"a", "b", "c", "d"}, {"d": {"a", "b", "c"}}) == {"d"}


def test_a_cut_inside_a_group_keeps_the_largest_connected_part() -> None:
    # only a-b is cut; c reaches both: {a, c} and {b, c} tie, the lower names win
    assert losing_side({"a", "b", "c"}, {"a": {"b"}}) == {"b"}
    # a 2 / 2 split: the side with the lowest name
    assert losing_side({"a", "b", "c", "d"}, {"a": {"c", "d"}, "b": {"c", "d"}}) == {"c", "d"}


def test_a_tie_goes_to_the_running_round_before_the_names() -> None:
    # a cut healing, read with one old report: n1's "cannot reach n0" is still there, n2's is already clear.
    # {n0, n2} and {n1, n2} tie; n1 and n2 trained together, so they go on and n0 waits a moment longer
    # instead of each of the pair hiding the other
    assert losing_side({"n0", "n1", "n2"}, {"n1": {"n0"}}, incumbents={"n1", "n2"}) == {"n0"}
    assert losing_side({"n0", "n1", "n2"}, {"n2": {"n0"}}, incumbents={"n1", "n2"}) == {"n0"}
    assert losing_side({"n0", "n1", "n2"}, {"n1": {"n0"}}, incumbents={"n0", "n1", "n2"}) == {"n1"}, "equal: names"
    # size still comes first: b, c and d reach each other, a alone trained
    assert losing_side({"a", "b", "c", "d"}, {"a": {"c", "d"}}, incumbents={"a"}) == {"a"}


def test_beyond_the_exact_search_incumbents_are_taken_first() -> None:
    nodes = [f"n{i:02d}" for i in range(EXACT_UP_TO + 4)]
    reports = {nodes[0]: {nodes[1]}}
    assert losing_side(nodes, reports) == {nodes[1]}
    assert losing_side(nodes, reports, incumbents=nodes[1:]) == {nodes[0]}


def test_reports_about_or_from_nodes_outside_the_round_are_ignored() -> None:
    assert losing_side({"a", "b"}, {"a": {"gone"}, "gone": {"b"}}) == set()
    assert losing_side({"a"}, {"a": {"a"}}) == set(), "a node never cuts itself"


def test_every_observer_gets_the_same_answer_from_the_same_reports() -> None:
    reports = {"n2": {"n0", "n1"}, "n3": {"n1"}}
    nodes = ["n3", "n1", "n0", "n2"]
    assert losing_side(nodes, reports) == losing_side(reversed(nodes), dict(reversed(reports.items())))
    assert losing_side(nodes, reports) == {"n2", "n3"}  # no three reach each other; (n0, n1) is the first pair


def test_beyond_the_exact_search_the_side_is_still_connected() -> None:
    nodes = [f"n{i:02d}" for i in range(EXACT_UP_TO + 4)]
    reports = {nodes[-1]: set(nodes[:-1]), nodes[0]: {nodes[1]}}
    losing = losing_side(nodes, reports)
    assert losing == {nodes[1], nodes[-1]}


def test_the_report_field_round_trips() -> None:
    assert encode([]) == "" and decode("") == frozenset()
    assert decode(encode(["n1_12_0", "n0_3_0"])) == {"n0_3_0", "n1_12_0"}
    assert encode(["b", "a"]) == " unreach=a,b", "sorted: the same set is the same value"
    assert decode("something else") == frozenset()
