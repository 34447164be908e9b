"""One in-place list operation by name, for the tests of list subclasses that keep state of their own
(``BlockTable``'s int32 row, ``PairStates``' counts): each applies the same operations to the subclass and to a
plain list and compares."""

from __future__ import annotations

from hypothesis import strategies as st


def list_operations(values, *extra):
    """Every in-place operation ``apply_list_op`` knows, on entries drawn from ``values``, plus ``extra`` ones (the
    caller's own reads, or ``sort`` for entries that order)."""
    return st.one_of(
        st.tuples(st.just("append"), values),
        st.tuples(st.just("extend"), st.lists(values, max_size=40)),
        st.tuples(st.just("iadd"), st.lists(values, max_size=5)),
        st.tuples(st.just("set"), st.integers(-50, 50), values),
        st.tuples(st.just("set_slice"), st.integers(-5, 30), st.integers(-5, 30), st.lists(values, max_size=6)),
        st.tuples(st.just("set_stride"), values),
        st.tuples(st.just("del"), st.integers(-50, 50)),
        st.tuples(st.just("del_slice"), st.integers(0, 30), st.integers(0, 30)),
        st.tuples(st.just("pop"), st.integers(-50, 50)),
        st.tuples(st.just("insert"), st.integers(-50, 50), values),
        st.tuples(st.just("remove"), values),
        st.tuples(st.just("clear")),
        st.tuples(st.just("reverse")),
        st.tuples(st.just("imul"), st.integers(0, 2)),
        *extra,
    )


def apply_list_op(table: list, op: tuple) -> None:
    """Kinds that do not fit the list's state (an assignment to an empty list, a value not in it) and kinds the
    list has no method for (the callers' own reads, e.g. ``row``) do nothing."""
    kind, *args = op
    if kind == "append":
        table.append(args[0])
    elif kind == "extend":
        table.extend(iter(args[0]))  # an iterator: a subclass must not read it twice
    elif kind == "iadd":
        table += args[0]
    elif kind == "set" and table:
        table[args[0] % len(table) - (len(table) if args[0] < 0 else 0)] = args[1]
    elif kind == "set_slice":
        table[args[0] : args[1]] = args[2]
    elif kind == "set_stride" and len(table) >= 2:
        table[::2] = [args[0]] * len(table[::2])
    elif kind == "del" and table:
        del table[args[0] % len(table)]
    elif kind == "del_slice":
        del table[args[0] : args[1]]
    elif kind == "pop" and table:
        table.pop(args[0] % len(table))
    elif kind == "insert":
        table.insert(args[0], args[1])
    elif kind == "remove" and args[0] in table:
        table.remove(args[0])
    elif kind == "clear":
        table.clear()
    elif kind == "reverse":
        table.reverse()
    elif kind == "sort":
        table.sort()
    elif kind == "imul":
        table *= args[0]
