"""carry.py: which block outputs later blocks take, and how a call gets them."""

from collections import namedtuple

import mlx.core as mx

from mlx_pager import carry
from mlx_pager.carry import Carries, Out


def _calls():
    """Four blocks as gemma4 E2B records them: blocks 2 and 3 take the keys
    and values (output 1) and the offset (output 2) of blocks 0 and 1."""
    mask = mx.zeros((2, 2))
    plain = ((mask, None), {"per_layer_input": None, "shared_kv": None, "offset": None})
    taking = lambda p: ((mask, None), {"per_layer_input": None, "shared_kv": Out(p, 1), "offset": Out(p, 2)})  # noqa: E731
    return [plain, plain, taking(0), taking(1)]


def test_the_map_names_producers_consumers_and_what_each_block_keeps():
    c = Carries(_calls())
    assert c.consumers == {(0, 1): [2], (0, 2): [2], (1, 1): [3], (1, 2): [3]}
    assert c.keep(0) == (1, 2) and c.keep(2) == ()
    assert c.takes(3) == ((1, 1), (1, 2)) and c.takes(0) == ()
    assert c.pairs() == [(0, 2), (0, 2), (1, 3), (1, 3)]
    assert not Carries(_calls()[:2])


def test_a_tail_or_prefix_edge_between_a_producer_and_its_consumer_is_crossed():
    c = Carries(_calls())
    assert [c.crosses(s) for s in range(5)] == [False, True, True, True, False]


def test_fill_puts_values_where_the_placeholders_were_and_strip_leaves_none():
    c = Carries(_calls())
    call = _calls()[3]
    kv = (mx.ones((1,)), mx.zeros((1,)))
    args, kwargs = c.fill(3, call, [kv, 0])
    assert kwargs["shared_kv"] is kv and kwargs["offset"] == 0 and args[0] is call[0][0]
    bare = c.strip(3, call)
    assert bare[1]["shared_kv"] is None and bare[1]["offset"] is None
    # a stripped call fills the same (leaf positions, not placeholders)
    assert c.fill(3, bare, [kv, 5])[1]["offset"] == 5
    assert c.fill(0, call, []) is call  # a block that takes nothing: its call as it is


def test_trees_keep_their_container_types_and_modules_stay_leaves():
    Pair = namedtuple("Pair", "k v")
    a, b = mx.ones((2,)), mx.arange(3)
    tree = {"p": Pair(a, b), "t": (a, [1, None])}
    same = carry.map_leaves(tree, lambda j, v: v)
    assert type(same["p"]) is Pair and type(same["t"]) is tuple and type(same["t"][1]) is list
    assert carry.leaves(tree) == [a, b, a, 1, None] or len(carry.leaves(tree)) == 5
    assert len(carry.diff_leaves(tree)) == 2  # the float arrays, not the integer one
    assert carry.unique_bytes(tree) == a.nbytes + b.nbytes  # `a` counted once

    class Module(dict):
        pass

    m = Module(x=1)
    assert carry.leaves([m]) == [m]


def test_arrays_round_trip_through_a_template():
    a, b = mx.ones((2,)), mx.zeros((3,))
    extras = [(a, b), 0]
    t = carry.template(extras)
    back = carry.with_array_leaves(t, carry.array_leaves(extras))
    assert back[0][0] is a and back[0][1] is b and back[1] == 0
    swapped = carry.with_diff_leaves(extras, [b, a])
    assert swapped[0][0] is b and swapped[0][1] is a
