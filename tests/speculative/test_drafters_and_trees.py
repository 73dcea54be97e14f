from __future__ import annotations

import random

from kapitsa.engine.speculative import NGramDrafter
from kapitsa.engine.speculative.controller import DraftLengthController
from kapitsa.engine.speculative.ngram import Reference, ReferenceIndex
from kapitsa.engine.speculative.tree import DraftTree, build_best_first


def test_ngram_copies_what_followed_the_latest_earlier_match() -> None:
    d = NGramDrafter(min_n=2, max_n=3)
    ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert d.propose(ctx, 4).tokens == (4, 5, 9, 9)
    # incremental: extend the context, the index follows
    assert d.propose([*ctx, 4], 2).tokens == (5, 9)
    # no earlier occurrence -> nothing
    assert d.propose([7, 8, 6], 4).tokens == ()
    # prefers the longest suffix match
    d2 = NGramDrafter(min_n=1, max_n=3)
    assert d2.propose([5, 6, 7, 1, 6, 7, 2, 6, 7], 1).tokens == (2,)
    assert d2.propose([5, 6, 7, 1, 9, 5, 6, 7], 2).tokens == (1, 9)


def _latest_copies(context: list[int], min_n: int, max_n: int, limit: int) -> list[int]:
    """The reference: scan for the longest suffix (min_n..max_n) seen earlier, latest first."""
    end = len(context)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = context[end - n :]
        starts = [e for e in range(end - 1, n - 1, -1) if context[e - n : e] == suffix]
        if starts:
            return starts[:limit]
    return []


def test_ngram_index_agrees_with_a_scan_of_the_context() -> None:
    rng = random.Random(0)
    for min_n, max_n in ((1, 3), (2, 4), (3, 3)):
        d = NGramDrafter(min_n=min_n, max_n=max_n)
        context: list[int] = []
        for _ in range(300):  # a small alphabet: many repeats, and suffixes that match at every n
            context.append(rng.randrange(6))
            starts = _latest_copies(context, min_n, max_n, 3)
            expected = tuple(context[starts[0] : starts[0] + 5]) if starts else ()
            assert d.propose(context, 5).tokens == expected
            tree = d.propose_tree(context, 3, branches=3)
            copies = [tuple(context[s : s + 3]) for s in _latest_copies(context, min_n, max_n, 12)]
            for node in range(1, len(tree)):
                branch = tuple(tree.tokens[i] for i in tree.path_to(node)[1:])
                assert any(copy[: len(branch)] == branch for copy in copies)


def test_controller_answers_change_when_an_update_or_cost_curve_does() -> None:
    c = DraftLengthController(max_draft=4)
    for _ in range(80):
        c.update(4, 0)
    assert c.best_length() == 0 and c.best_length() == 0  # asked twice: the same answer
    for _ in range(40):
        c.update(4, 4)
    assert c.best_length() > 0  # the estimate changed: so does the answer
    c.set_cost_curve([1.0] + [50.0] * 4)
    assert c.best_length() == 0  # verifies priced out


def test_tree_preorder_and_masks() -> None:
    # root(10) -> a(1) -> c(3); root -> b(2)
    tree = DraftTree((10, 1, 3, 2), (-1, 0, 1, 0))
    mask = tree.ancestor_mask()
    assert mask[2].tolist() == [True, True, True, False]
    assert mask[3].tolist() == [True, False, False, True]
    assert tree.depths() == [0, 1, 2, 1]
    assert tree.children(0) == [1, 3] and tree.path_to(2) == [0, 1, 2]


def test_best_first_tree_respects_budget_and_order() -> None:
    def expand(path):
        return [(len(path) * 10 + 1, -0.1), (len(path) * 10 + 2, -2.0)]

    tree = build_best_first(99, expand, budget=4, top_k=2)
    assert len(tree) == 5 and tree.tokens[0] == 99
    assert tree.tokens[1:4] == (1, 11, 21)  # the confident chain first


def test_controller_turns_speculation_up_and_down() -> None:
    c = DraftLengthController(max_draft=6)
    for _ in range(60):
        c.update(6, 6)
    assert c.choose() == 6
    for _ in range(80):
        c.update(c.max_draft, 0)
    assert c.choose() == 0
    assert any(c.choose() == 1 for _ in range(c.probe_every))  # it probes again


def test_controller_rests_between_probes_by_position() -> None:
    c = DraftLengthController(max_draft=4)
    for _ in range(80):
        c.update(4, 0)
    assert not c.resting(100)
    assert c.choose(100) == 0  # off from position 100
    assert c.resting(101) and c.resting(115) and not c.resting(116)
    assert c.choose(116) == 1  # the probe is due 16 tokens later
    assert c.resting(117)  # and the next one 16 after that
    for _ in range(40):
        c.update(4, 4)  # drafts pay again: speculation comes back on
    assert c.choose(140) > 0 and not c.resting(141)


def test_a_draft_models_best_first_tree_holds_its_greedy_chain_and_leaves_the_cache_committed() -> None:
    import mlx.core as mx

    from kapitsa.engine.speculative.draft_model import DraftModelDrafter
    from tests.models.builders import build_ours

    model = build_ours("qwen3_5_dense")
    context = [5, 9, 14, 3, 7, 7, 21]
    drafter = DraftModelDrafter(model)
    chain = drafter.propose(context, 3).tokens
    tree = drafter.propose_tree(context, 6)
    assert len(tree) == 7 and tree.tokens[0] == context[-1]
    assert len(set(tree.children(0))) >= 1
    # the best-first tree holds the draft model's greedy path as deep as the tree reaches there
    node, greedy = 0, []
    while (kids := tree.children(node)) and len(greedy) < len(chain):
        node = next((k for k in kids if tree.tokens[k] == chain[len(greedy)]), -1)
        if node < 0:
            break
        greedy.append(tree.tokens[node])
    assert greedy and tuple(greedy) == chain[: len(greedy)]
    assert drafter.propose(context, 3).tokens == chain  # the cache is back at the committed point
    assert mx.array(tree.depths()).max().item() >= 1


def test_a_reference_is_drafted_from_in_order_and_wins_ties() -> None:
    """A predicted output: its continuation of the context's suffix is the draft; of several
    occurrences of that suffix, the one after where the last match left off."""
    d = NGramDrafter(min_n=2, max_n=3)
    d.add_reference([1, 2, 7, 8, 1, 2, 5, 6])
    assert d.propose([9, 1, 2], 2).tokens == (7, 8)  # the context saw no [1, 2] before: the reference
    assert d.propose([9, 1, 2, 7, 8, 1, 2], 2).tokens == (5, 6)  # the later [1, 2]: read in order
    # a longer match in the context itself beats a shorter one in the reference
    d2 = NGramDrafter(min_n=2, max_n=3)
    d2.add_reference([4, 5, 1])
    assert d2.propose([3, 4, 5, 6, 3, 4, 5], 1).tokens == (6,)
    # an equal length: the reference
    d3 = NGramDrafter(min_n=2, max_n=3)
    d3.add_reference([9, 3, 4, 5, 1])
    assert d3.propose([3, 4, 5, 6, 3, 4, 5], 1).tokens == (1,)
    tree = d3.propose_tree([3, 4, 5, 6, 3, 4, 5], 4)
    assert 1 in tree.tokens and 6 in tree.tokens  # both continuations are branches


class _CountedReads(list):
    """A list that counts the entries read from it."""

    reads = 0

    def __iter__(self):  # noqa: ANN204
        _CountedReads.reads += len(self)
        return super().__iter__()

    def __getitem__(self, index):  # noqa: ANN001, ANN204
        _CountedReads.reads += 1
        return super().__getitem__(index)


def test_a_long_reference_finds_its_next_occurrence_without_a_scan() -> None:
    """The drafter asks the reference every decode step (shadow guesses too): of a common n-gram's
    thousands of occurrences in a long prediction, the one after the cursor is found by bisection."""
    reference = Reference(ReferenceIndex([1, 2] * 20_000 + [7, 8]))
    reference._cursor = len(reference.tokens) - 4  # read far into the reference
    ends = reference._ends[(1, 2)]
    reference._ends[(1, 2)] = _CountedReads(ends)
    _CountedReads.reads = 0
    assert reference.follow([5, 1, 2], limit=4) == (1, 2, 7, 8)
    assert _CountedReads.reads < 64
