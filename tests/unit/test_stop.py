from __future__ import annotations

import pytest

from kapitsa.engine.runner.stop import StopMatcher


def _run(stops, deltas):
    matcher = StopMatcher(stops)
    out, hit = [], None
    for delta in deltas:
        check = matcher.feed(delta)
        out.append(check.text)
        if check.stop:
            hit = check.stop
            break
    else:
        out.append(matcher.flush())
    return "".join(out), hit, out


def test_stop_string_split_across_three_tokens_is_not_emitted() -> None:
    text, hit, chunks = _run(["</answer>"], ["The result", " is 4</", "ans", "wer> and more"])
    assert text == "The result is 4"
    assert hit == "</answer>"
    assert chunks[1] == " is 4"  # "</" held back while it could still be a stop string


def test_held_text_is_released_when_the_match_fails() -> None:
    text, hit, chunks = _run(["STOP"], ["a ST", "OOP b"])
    assert hit is None and text == "a STOOP b"
    assert chunks[0] == "a "


def test_held_text_flushes_at_the_end() -> None:
    text, hit, _ = _run(["###"], ["x #", "#"])
    assert hit is None and text == "x ##"


@pytest.mark.parametrize(
    ("stops", "deltas", "expected", "stop"),
    [
        (["a", "ab"], ["xab"], "x", "ab"),  # same position: the longer one wins
        (["cd", "bc"], ["ab", "cde"], "a", "bc"),  # earliest occurrence wins
        ([], ["abc"], "abc", None),
        ([""], ["abc"], "abc", None),
        (["\n\n"], ["line\n", "\nnext"], "line", "\n\n"),
    ],
)
def test_earliest_and_longest_match(stops, deltas, expected, stop) -> None:
    text, hit, _ = _run(stops, deltas)
    assert (text, hit) == (expected, stop)
