"""The pure-Python parts of tools/train_checkpoints.py: corpus split, function extraction, chat turns,
the chat template (checked against transformers' own rendering) and the acceptance replay."""

from __future__ import annotations

import random

import pytest
from tinyckpt import chats, corpus, replay, template

from tests.checkpoints.conftest import DEMO

SOURCE = '''
class Box:
    def get(self, key, default=None):
        """Return the value for *key*.

        More text.
        """
        value = self._data.get(key)
        if value is None:
            return default
        return value

    @property
    def size(self):
        return len(self._data)

def short(): return 1

def add(a,
        b):
    return a + b
'''


def test_held_out_split_is_by_path_and_stable() -> None:
    names = [f"pkg/module_{i}.py" for i in range(2000)]
    held = [n for n in names if corpus.is_held_out(n)]
    assert held == [n for n in names if corpus.is_held_out(n)]  # no randomness
    assert 0.03 < len(held) / len(names) < 0.07
    files = [corpus.SourceFile(n, "x = 1\n") for n in names]
    train, held_out = corpus.split_files(files)
    assert {f.name for f in held_out} == set(held) and not {f.name for f in train} & set(held)


def test_functions_keep_header_docstring_and_dedented_source() -> None:
    found = {f.name: f for f in corpus.functions_in(corpus.SourceFile("box.py", SOURCE))}
    assert set(found) == {"get", "add"}  # decorated and one-line functions are skipped
    get = found["get"]
    assert get.header == "def get(self, key, default=None):"
    assert get.docstring.startswith("Return the value for *key*.")
    assert get.source.startswith("def get(") and get.source.endswith("return value")
    assert found["add"].header == "def add(a,\n        b):"


def test_task_prompts_hide_the_body_and_fix_lines_differ() -> None:
    get = next(f for f in corpus.functions_in(corpus.SourceFile("box.py", SOURCE)) if f.name == "get")
    prompt = chats._prompt_upto_docstring(get)
    assert prompt.endswith('"""') and "self._data.get" not in prompt
    assert "More text" not in chats._without_docstring(get)
    rng = random.Random(0)
    for line in get.source.splitlines()[1:]:
        bad = chats._corrupt(line, rng)
        assert bad is None or bad != line.strip()


def test_conversations_are_deterministic_chat_turns() -> None:
    pool = [("box.py", f) for f in corpus.functions_in(corpus.SourceFile("box.py", SOURCE))]
    first, again = chats.make_conversations(pool, 30, seed=3), chats.make_conversations(pool, 30, seed=3)
    assert first == again
    for text in first:
        assert text.count("<|im_start|>user\n") >= 1 and text.endswith("<|im_end|>\n")
        assert "<|im_start|>assistant\n<think>\n" in text  # the last answer always has its think block


CONVERSATIONS = [
    ([{"role": "user", "content": "def f(x):"}], None),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "old thought"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nnew thought\n</think>\n\na2"},
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "read it"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "read_file", "arguments": {"path": "a.py", "lines": [1, 2]}},
                    }
                ],
            },
            {"role": "tool", "content": "print(1)"},
            {"role": "tool", "content": "print(2)"},
        ],
        [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}],
    ),
]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_template_renders_as_transformers_does(case: int, thinking: bool) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(DEMO)
    messages, tools = CONVERSATIONS[case]
    expected = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    assert (
        template.render_chat(messages, tools=tools, add_generation_prompt=True, enable_thinking=thinking)
        == expected
    )


def test_generation_prompt_closes_thinking_unless_enabled() -> None:
    messages = [{"role": "user", "content": "hi"}]
    off = template.render_chat(messages, add_generation_prompt=True)
    on = template.render_chat(messages, add_generation_prompt=True, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    with pytest.raises(Exception, match="No user query"):
        template.render_chat([{"role": "system", "content": "s"}])


def test_replay_counts_verify_steps_like_greedy_verification() -> None:
    sequence = list(range(10)) + [5, 6, 7, 8, 1, 2]
    prompt = 10

    def perfect(k: int) -> replay.Proposer:
        return lambda context, _: sequence[len(context) : len(context) + k]

    assert replay.replay(sequence, prompt, perfect(3)) == (2, 6, 5, 5)  # 3 accepted + bonus, then the last 2
    assert replay.replay(sequence, prompt, lambda context, _: [99, 99]) == (6, 6, 12, 0)
    assert replay.replay(sequence, prompt, lambda context, _: []) == (6, 6, 0, 0)


def test_ngram_proposer_continues_the_latest_earlier_match() -> None:
    propose = replay.ngram_proposer(k=3)
    assert propose([1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2, 3], 0) == [7, 1, 2]  # the latest match wins
    assert propose([5, 6, 7], 0) == []
    assert propose([4, 8, 4], 0) == [8, 4]
