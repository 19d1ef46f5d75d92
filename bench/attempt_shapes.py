"""Attempts of different typologies that are the same graph, and what that leaves a detector to name.

Why: the own-typology score asks a detector to name an attempt's typology from its payments. Where the
patterns file gives two typologies to attempts with the same payment graph (one payment between two
accounts is a fan-in of degree 1 in one attempt and a bipartite edge in another; A -> B -> A is a stack
and a cycle of two hops), a detector that names a typology by what the payments look like names one of
them, and the rest count as misses whatever it does. `named_by_shape` is the share of attempts such a
detector can name at best: per shape, the attempts of its most frequent typology, counting only attempts
with evidence (`bench.amlworld_detection.with_evidence`).

The shape is the attempt's directed multigraph up to renaming its accounts, without times or amounts: a
detector that learns the generator's amounts or timing per typology could pass the bound, one that reads
shapes cannot. Isomorphism is decided exactly: colour refinement sorts the attempts, and a backtracking
search over colour-preserving mappings tells apart the look-alikes that refinement cannot (two
triangles against a hexagon).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

Edges = tuple[tuple[str, str], ...]


def _colours(edges: Edges) -> dict[str, int]:
    """Colour refinement (1-dimensional Weisfeiler-Leman) on a directed multigraph. A colour is a hash of
    the node's colour and its payees' and payers' colours a round before, starting equal: the same in
    every graph, so nodes of two graphs compare, and an isomorphism maps each node to one of its colour."""
    nodes = sorted({a for edge in edges for a in edge})
    colour = dict.fromkeys(nodes, 0)
    for _ in range(len(nodes)):
        out: dict[str, list[int]] = {a: [] for a in nodes}
        into: dict[str, list[int]] = {a: [] for a in nodes}
        for payer, payee in edges:
            out[payer].append(colour[payee])
            into[payee].append(colour[payer])
        colour = {a: hash((colour[a], tuple(sorted(out[a])), tuple(sorted(into[a])))) for a in nodes}
    return colour


def _key(edges: Edges) -> tuple[int, tuple[int, ...]]:
    """What isomorphic graphs share: the count of payments and the histogram of refined colours."""
    return len(edges), tuple(sorted(_colours(edges).values()))


def isomorphic(first: Edges, second: Edges) -> bool:
    """Whether two payment graphs are the same up to renaming accounts (multiplicities counted): a
    backtracking search over colour-preserving mappings, each checked against every edge."""
    a_colour, b_colour = _colours(first), _colours(second)
    if len(first) != len(second) or sorted(a_colour.values()) != sorted(b_colour.values()):
        return False  # what `_key` compares, from the colours the search needs anyway
    a_nodes, b_nodes = _connected_order(first), sorted(b_colour)
    a_count, b_count = Counter(first), Counter(second)
    mapping: dict[str, str] = {}

    def consistent(a: str, b: str) -> bool:
        if a_count[(a, a)] != b_count[(b, b)]:
            return False
        return all(
            a_count[(a, x)] == b_count[(b, y)] and a_count[(x, a)] == b_count[(y, b)]
            for x, y in mapping.items()
        )

    def extend(i: int) -> bool:
        if i == len(a_nodes):
            return True
        a = a_nodes[i]
        for b in b_nodes:
            if b in mapping.values() or a_colour[a] != b_colour[b] or not consistent(a, b):
                continue
            mapping[a] = b
            if extend(i + 1):
                return True
            del mapping[a]
        return False

    return extend(0)


def _connected_order(edges: Edges) -> list[str]:
    """The nodes, each after one it shares a payment with where there is one: a node is then mapped next
    to its neighbours' images, and whole components one after another."""
    neighbours: dict[str, set[str]] = {}
    for payer, payee in edges:
        neighbours.setdefault(payer, set()).add(payee)
        neighbours.setdefault(payee, set()).add(payer)
    order: list[str] = []
    seen: set[str] = set()
    for start in sorted(neighbours):
        if start in seen:
            continue
        queue = [start]
        seen.add(start)
        while queue:
            node = queue.pop(0)
            order.append(node)
            for other in sorted(neighbours[node] - seen):
                seen.add(other)
                queue.append(other)
    return order


def shapes(graphs: Sequence[Edges]) -> list[int]:
    """Per payment graph, the number of its shape: equal numbers, isomorphic graphs."""
    classes: dict[tuple[Any, ...], list[tuple[int, Edges]]] = {}
    numbers: list[int] = []
    count = 0
    for edges in graphs:
        bucket = classes.setdefault(_key(edges), [])
        for number, seen in bucket:
            if isomorphic(edges, seen):
                numbers.append(number)
                break
        else:
            bucket.append((count, edges))
            numbers.append(count)
            count += 1
    return numbers


def named_by_shape(attempts: Iterable[Any], payments: Iterable[Any], evidence: set[str]) -> dict[str, Any]:
    """The share of attempts a detector that names one typology per shape can name, counting attempts
    with evidence only; and per typology, how many of its attempts share their shape with another
    typology's."""
    ends = {p.payment_id: (p.payer, p.payee) for p in payments}
    listed = [(a.typology, tuple(ends[pid] for pid in a.payment_ids), a.payment_ids) for a in attempts]
    numbers = shapes([edges for _, edges, _ in listed])
    per_shape: dict[int, Counter[str]] = {}
    with_evidence: dict[int, Counter[str]] = {}
    for number, (typology, _, ids) in zip(numbers, listed, strict=True):
        per_shape.setdefault(number, Counter())[typology] += 1
        if any(pid in evidence for pid in ids):
            with_evidence.setdefault(number, Counter())[typology] += 1
    shared: Counter[str] = Counter()
    example: dict[int, Edges] = {}
    for number, (typology, edges, _) in zip(numbers, listed, strict=True):
        shared[typology] += len(per_shape[number]) > 1
        example.setdefault(number, edges)
    best = sum(max(counts.values()) for counts in with_evidence.values())
    return {
        "named_by_shape": round(best / len(listed), 3) if listed else None,
        "shapes": len(per_shape),
        "shared_shape": dict(sorted(shared.items())),
        "shared_shapes": [
            {
                "payments": len(example[number]),
                "accounts": len({a for edge in example[number] for a in edge}),
                "typologies": dict(counts.most_common()),
            }
            for number, counts in sorted(per_shape.items(), key=lambda item: -item[1].total())
            if len(counts) > 1
        ],
    }


def repeated_edges(attempts: Iterable[Any], payments: Iterable[Any]) -> dict[str, Any]:
    """How many attempts pay again between two accounts that an earlier payment of another attempt paid
    between: the same way (`repeated`) or the other way (`reversed`); and, by the attempt's size (1, 2,
    3+ payments), how many do either, of how many (`by_size`). AMLworld's laundering accounts launder
    together again, mostly in attempts of one or two payments; a simulator that draws each attempt's
    accounts afresh does not."""
    attempts = list(attempts)
    by_id = {p.payment_id: p for p in payments}
    paid = sorted(
        ((by_id[pid], n) for n, attempt in enumerate(attempts) for pid in attempt.payment_ids),
        key=lambda item: item[0].ts,
    )
    earlier: dict[tuple[str, str], set[int]] = {}
    repeated: set[int] = set()
    turned: set[int] = set()
    for payment, n in paid:
        edge = (payment.payer, payment.payee)
        if earlier.get(edge, set()) - {n}:
            repeated.add(n)
        if earlier.get(edge[::-1], set()) - {n}:
            turned.add(n)
        earlier.setdefault(edge, set()).add(n)
    size = {
        n: ("1", "2", "3+")[min(len(a.payment_ids), 3) - 1] for n, a in enumerate(attempts) if a.payment_ids
    }
    either, total = Counter(size[n] for n in repeated | turned), Counter(size.values())
    by_size = {key: [either[key], total[key]] for key in ("1", "2", "3+")}
    return {
        "attempts": len({n for _, n in paid}),
        "repeated": len(repeated),
        "reversed": len(turned),
        "by_size": by_size,
    }
