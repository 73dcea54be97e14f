"""Flint against mlx-vlm 0.7.10's own Flint classes, and the cache invariants on its sliding windows.

The tiny Flint has a window of 16 positions; every prompt here is longer, and decoding, drafts,
trees and batches cross the window edge (where the rotating cache wraps)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_vlm.models.flint import LanguageModel, ModelConfig

from kapitsa.engine.cache.window import RotatingKVCache
from kapitsa.engine.models import get_model_module
from kapitsa.testing.tiny_flint import TINY_WINDOW, flint_config, flint_weights

PROMPT = [(7 * i + 3) % 480 + 3 for i in range(40)]  # 40 tokens: 2.5 windows
TOL = 1e-4


def build_flint(seed: int = 0, **overrides):
    cfg = flint_config(**overrides)
    weights = {k: mx.array(v) for k, v in flint_weights(cfg, seed=seed).items()}
    module = get_model_module("flint")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    mx.eval(model.parameters())
    return model


def build_reference(seed: int = 0, **overrides):
    """mlx-vlm's Flint language model with the same Hugging Face-named weights."""
    cfg = flint_config(**overrides)
    weights = {k: mx.array(v) for k, v in flint_weights(cfg, seed=seed).items()}
    model = LanguageModel(ModelConfig.from_dict(cfg))
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    mx.eval(model.parameters())
    return model


def _ref_logits(ref, tokens, cache=None):
    return ref(mx.array([tokens]), cache=cache).logits


def _diff(a, b) -> float:
    return mx.abs(a - b).max().item()


def test_the_tiny_flint_has_every_layer_kind():
    model = build_flint()
    attn = [layer.self_attn for layer in model.layers]
    assert [a.window for a in attn] == [TINY_WINDOW, None, TINY_WINDOW, TINY_WINDOW]
    assert attn[1].rope is None and attn[0].rope is not None
    caches = model.make_cache().layers
    assert [type(c).__name__ for c in caches] == [
        "RotatingKVCache",
        "KVCache",
        "RotatingKVCache",
        "RotatingKVCache",
    ]
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["FlintMoe", "FlintMoe", "MLP", "FlintMoe"]


def test_prefill_logits_match_mlx_vlm():
    ours, ref = build_flint(), build_reference()
    got, want = ours(mx.array([PROMPT])), _ref_logits(ref, PROMPT)
    assert got.shape == want.shape == (1, len(PROMPT), 512)
    assert _diff(got, want) < TOL


def test_chunked_prefill_matches_mlx_vlm():
    """Prefill in chunks of 7 through both caches: each chunk attends across the window edge."""
    ours, ref = build_flint(), build_reference()
    cache, ref_cache = ours.make_cache(), ref.make_cache()
    for start in range(0, len(PROMPT), 7):
        chunk = PROMPT[start : start + 7]
        assert _diff(ours(mx.array([chunk]), cache), _ref_logits(ref, chunk, ref_cache)) < TOL, start


def test_32_greedy_tokens_match_mlx_vlm():
    ours, ref = build_flint(), build_reference()
    cache, ref_cache = ours.make_cache(), ref.make_cache()
    got = ours(mx.array([PROMPT]), cache)[0, -1]
    want = _ref_logits(ref, PROMPT, ref_cache)[0, -1]
    tokens, worst = [], 0.0
    for _ in range(32):
        worst = max(worst, _diff(got, want))
        tok = int(mx.argmax(got).item())
        assert tok == int(mx.argmax(want).item()), len(tokens)
        tokens.append(tok)
        got = ours(mx.array([[tok]]), cache)[0, -1]
        want = _ref_logits(ref, [tok], ref_cache)[0, -1]
    assert worst < TOL
    assert len(set(tokens)) > 8  # a real continuation, not one token repeated


def test_parity_detects_a_wrong_sink_and_a_missing_window():
    """Negative controls: a changed sink, or a window wider than the checkpoint's, must show."""
    ref = _ref_logits(build_reference(), PROMPT)
    ours = build_flint()
    ours.layers[0].self_attn.softmax_offset = ours.layers[0].self_attn.softmax_offset + 1.0
    assert _diff(ours(mx.array([PROMPT])), ref) > 1e-3
    wide = build_flint(sliding_window=4 * TINY_WINDOW)
    logits = wide(mx.array([PROMPT]))
    assert _diff(logits[:, :TINY_WINDOW], ref[:, :TINY_WINDOW]) < TOL  # the same up to the edge
    assert _diff(logits[:, TINY_WINDOW:], ref[:, TINY_WINDOW:]) > 1e-3


def _continue(model, cache, tokens=(77, 5, 190)):
    return [model(mx.array([[t]]), cache)[0, -1] for t in tokens]


def _worst(xs, ys) -> float:
    return max(_diff(x, y) for x, y in zip(xs, ys, strict=True))


@pytest.mark.parametrize(
    ("prompt_len", "draft_len", "drop"), [(14, 6, 0), (14, 6, 1), (14, 6, 4), (14, 6, 6), (30, 20, 17)]
)
def test_rollback_equals_never_decoding(prompt_len, draft_len, drop):
    """Drafts crossing the window edge; the last case drafts more than a window and keeps 3."""
    model = build_flint()
    prompt, draft = PROMPT[:prompt_len], [(11 * i + 5) % 400 + 3 for i in range(draft_len)]
    spec = model.make_cache()
    model(mx.array([prompt]), spec)
    model(mx.array([draft]), spec, record=True)
    spec.rollback(drop)
    plain = model.make_cache()
    model(mx.array([prompt + draft[: draft_len - drop]]), plain)
    assert spec.offsets == plain.offsets
    assert _worst(_continue(model, spec), _continue(model, plain)) < TOL


def test_rollback_needs_a_record():
    model = build_flint()
    cache = model.make_cache()
    model(mx.array([PROMPT[:20]]), cache)
    with pytest.raises(ValueError):
        cache.rollback(2)


def test_checkpoint_restore_is_exact_across_a_wrap():
    model = build_flint()
    cache = model.make_cache()
    model(mx.array([PROMPT[:12]]), cache)
    ckpt = cache.checkpoint()
    before = _continue(model, cache, range(40, 60))  # 20 decode steps: the ring wraps
    cache.restore(ckpt)
    assert _worst(_continue(model, cache, range(40, 60)), before) < 1e-6


TREE = [42, 17, 250, 8, 130, 77, 5]
PARENTS = [-1, 0, 1, 0, 3, 1, 5]  # preorder: 0 -> {1 -> {2, 5 -> 6}, 3 -> 4}


def _path(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _chain(model, prompt, tokens):
    cache = model.make_cache()
    model(mx.array([prompt]), cache)
    return model(mx.array([tokens]), cache)[0, -1], cache


def test_tree_nodes_equal_their_chains_and_commit_across_the_edge():
    model = build_flint()
    prompt = PROMPT[:14]  # tree depths 0..3 sit at positions 14..17: across the edge at 16
    cache = model.make_cache()
    model(mx.array([prompt]), cache)
    logits = model(mx.array([TREE]), cache, parents=[PARENTS])[0]
    assert cache.offsets == [len(prompt)]
    for node in range(len(TREE)):
        want, _ = _chain(model, prompt, [TREE[i] for i in _path(PARENTS, node)])
        assert _diff(logits[node], want) < TOL, node
    path = _path(PARENTS, 6)  # [0, 1, 5, 6]: not contiguous in node order
    cache.commit_path([path])
    _, plain = _chain(model, prompt, [TREE[i] for i in path])
    assert _worst(_continue(model, cache), _continue(model, plain)) < TOL


def test_batched_trees_with_different_offsets():
    model = build_flint()
    prompts = [PROMPT[:14], PROMPT[:31]]
    cache = model.make_cache(2)
    model(mx.array([prompts[0] + [0] * 17, prompts[1]]), cache, lengths=[14, 31])
    parents = [PARENTS, [-1, 0, 0, 2, 3, 0, 5]]
    trees = [TREE, TREE[::-1]]
    logits = model(mx.array(trees), cache, parents=parents)
    for b in range(2):
        for node in (2, 4, 6):
            want, _ = _chain(model, prompts[b], [trees[b][i] for i in _path(parents[b], node)])
            assert _diff(logits[b, node], want) < TOL
    paths = [_path(parents[0], 4), []]
    cache.commit_path(paths)
    assert cache.offsets == [14 + 3, 31]
    got = model(mx.array([[9], [9]]), cache)[:, -1]
    for b in range(2):
        solo = model.make_cache()
        model(mx.array([prompts[b] + [trees[b][i] for i in paths[b]]]), solo)
        assert _diff(got[b], model(mx.array([[9]]), solo)[0, -1]) < TOL


PROMPTS = [PROMPT[:7], PROMPT[:20], PROMPT[5:38]]  # shorter than, about and twice the window


def _alone(model, prompt, steps):
    cache = model.make_cache()
    rows = [model(mx.array([prompt]), cache)[0, -1]]
    for _ in range(steps):
        rows.append(model(mx.array([[int(mx.argmax(rows[-1]).item())]]), cache)[0, -1])
    return rows


def test_batched_prefill_and_decode_equal_alone():
    """Ragged prefill, then 20 batched decode steps at three different offsets (rows wrap at
    different steps; the shortest fills its window meanwhile)."""
    model = build_flint()
    steps = 20
    alone = [_alone(model, p, steps) for p in PROMPTS]
    T = max(map(len, PROMPTS))
    cache = model.make_cache(len(PROMPTS))
    lengths = [len(p) for p in PROMPTS]
    out = model.forward(mx.array([p + [0] * (T - len(p)) for p in PROMPTS]), cache, lengths=lengths)
    rows = list(model.logits(model.last_hidden(out.hidden, lengths))[:, 0])
    for step in range(steps + 1):
        for b in range(len(PROMPTS)):
            assert _diff(rows[b], alone[b][step]) < TOL, (step, b)
        nxt = mx.array([[int(mx.argmax(r).item())] for r in rows])
        rows = list(model(nxt, cache)[:, -1])


def test_select_and_merge_keep_each_window():
    model = build_flint()
    solo = []
    for p in PROMPTS:
        c = model.make_cache()
        model(mx.array([p]), c)
        solo.append(c)
    merged = solo[0].merge(solo)
    assert all(isinstance(c, RotatingKVCache) for c in (merged[0], merged[2]))
    got = model(mx.array([[9]] * 3), merged)[:, -1]
    merged.rollback(0)
    one = merged.select([2])
    later = model(mx.array([[4]]), one)[0, -1]
    for b, p in enumerate(PROMPTS):
        c = model.make_cache()
        model(mx.array([p]), c)
        assert _diff(got[b], model(mx.array([[9]]), c)[0, -1]) < TOL
        if b == 2:
            assert _diff(later, model(mx.array([[4]]), c)[0, -1]) < TOL


def test_8bit_kv_keeps_sinks_and_windows():
    """--kv-bits 8 quantizes the full-attention K/V only (their sink term is applied over the
    dequantized rows); the rings stay as computed. Greedy tokens equal float K/V's."""
    from kapitsa.engine.cache.quantized_kv import QuantizedKVCache, use_kv_bits

    model = build_flint(head_dim=32)  # MLX quantizes K/V rows in groups of 32 or 64

    def run(bits):
        use_kv_bits(model, bits)
        return _alone(model, PROMPT, 20), model.make_cache()

    (exact, _), (quantized, cache) = run(None), run(8)
    assert [type(c) for c in cache.layers] == [
        RotatingKVCache,
        QuantizedKVCache,
        RotatingKVCache,
        RotatingKVCache,
    ]
    assert [int(mx.argmax(r).item()) for r in quantized] == [int(mx.argmax(r).item()) for r in exact]
    assert 0 < _worst(quantized, exact) < 0.05
