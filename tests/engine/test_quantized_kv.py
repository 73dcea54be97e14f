"""Quantized K/V (cache/quantized_kv.py): bytes per token, error against float K/V, and the cache
invariants that speculation, batching and the prefix cache rely on, with 8- and 4-bit K/V."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from engine_standins import EOS, ByteTokenizer
from test_prefix_reuse import replay
from test_speculative_engine import OracleDrafter

from kapitsa.engine.cache.file import read_header
from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.cache.layers import KVCache, StepInfo
from kapitsa.engine.cache.quantized_kv import QuantizedKVCache, quantized_attention, use_kv_bits
from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.speculative.factory import make_decode_strategy
from kapitsa.engine.types import GenerationRequest, ModelInfo, SamplingParams, TokenEvent

HKV, H, D = 2, 4, 64
BITS = pytest.mark.parametrize("bits", [8, 4])
# Bounds on the tiny models (measured: docs/results.md, "Quantized KV"): the largest logit error
# relative to the largest logit, and the share of positions whose greedy token matches float K/V.
ERROR_BOUND = {8: 0.01, 4: 0.08}
AGREEMENT_BOUND = {8: 0.99, 4: 0.93}


def fresh_model(kind: str):
    """A tiny model of its own (K/V bits are set on the model; the session's shared ones stay float).
    Nemotron's tiny head (16) is below MLX's smallest quantization group, so it gets heads of 32."""
    from kapitsa.engine.models import get_model_module
    from kapitsa.testing.tiny import tiny_config

    config = tiny_config(kind, **({"head_dim": 32} if kind == "nemotron_h" else {}))
    module = get_model_module(config["model_type"])
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def _qkv(B: int, T: int, seed: int, dtype=mx.float32) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(seed)
    return tuple(mx.random.normal((B, n, T, D)).astype(dtype) for n in (H, HKV, HKV))


@BITS
def test_kv_bytes_per_token_halve_and_quarter(bits: int) -> None:
    _, k, v = _qkv(1, 300, 0, mx.bfloat16)
    info = StepInfo(300, [300], [0])
    full, quant = KVCache(HKV, D), QuantizedKVCache(HKV, D, bits=bits)
    full.update(k, v, info)
    quant.update(k, v, info)
    mx.eval(*full.slots(), *quant.slots())
    ratio = quant.nbytes / full.nbytes  # both hold 512 positions: the measured arrays
    # D*bits/8 packed bytes + a bf16 scale and bias per group of 64, against 2*D bf16 bytes
    assert ratio == pytest.approx((D * bits / 8 + 4) / (2 * D))
    assert ratio <= {8: 0.54, 4: 0.29}[bits]
    assert quant.nbytes == quant.bytes_per_token(mx.bfloat16) * 512  # K and V of every head


@BITS
def test_attention_error_against_full_precision(bits: int) -> None:
    q, k, v = _qkv(2, 40, 1)
    cache = QuantizedKVCache(HKV, D, bits=bits)
    info = StepInfo(40, [40, 40], [0, 0])
    keys, values = cache.update(k, v, info)
    got = quantized_attention(q, keys, values, "causal", scale=D**-0.5, group_size=64, bits=bits)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal")
    err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
    assert err < {8: 0.01, 4: 0.15}[bits], err


def _teacher_forced(model, tokens: mx.array, bits: int | None) -> mx.array:
    use_kv_bits(model, bits)
    cache = model.make_cache(1)
    out = mx.concatenate([model(tokens[:, i : i + 64], cache) for i in range(0, tokens.shape[1], 64)], axis=1)
    use_kv_bits(model, None)
    return out[0]


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
@BITS
def test_greedy_agreement_and_logit_error_against_float_kv(kind: str, bits: int) -> None:
    model = fresh_model(kind)
    tokens = mx.array([[3 + (i * 37) % 250 for i in range(320)]], dtype=mx.int32)
    ref, got = _teacher_forced(model, tokens, None), _teacher_forced(model, tokens, bits)
    error = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
    agreement = (got.argmax(-1) == ref.argmax(-1)).mean().item()
    print(
        f"{kind} {bits}-bit KV: logit error {error:.4f} of the largest logit, greedy agreement {agreement:.3f}"
    )
    assert error < ERROR_BOUND[bits] and agreement >= AGREEMENT_BOUND[bits], (error, agreement)
    assert error > 0  # the cache did store quantized K/V


@BITS
def test_tree_commit_equals_decoding_the_path(bits: int) -> None:
    model = fresh_model("qwen3_5")
    use_kv_bits(model, bits)
    prompt = mx.array([[5, 9, 12, 40, 41, 42]], dtype=mx.int32)
    tree_cache, chain_cache = model.make_cache(1), model.make_cache(1)
    model(prompt, tree_cache)
    model(prompt, chain_cache)
    nodes, parents = [7, 8, 9, 10, 11], [-1, 0, 1, 0, 3]  # two branches; keep 7 -> 10 -> 11
    model(mx.array([nodes], dtype=mx.int32), tree_cache, parents=[parents])
    tree_cache.commit_path([[0, 3, 4]])
    tree_logits = model(mx.array([[12]], dtype=mx.int32), tree_cache)
    chain_logits = model(mx.array([[7, 10, 11, 12]], dtype=mx.int32), chain_cache)[:, -1:]
    assert tree_cache.offsets == chain_cache.offsets == [10]
    assert mx.allclose(tree_logits, chain_logits, atol=1e-4).item()
    quantized = [c for c in tree_cache.layers if isinstance(c, QuantizedKVCache)]
    assert quantized and all(c.bits == bits for c in quantized)


@BITS
def test_merge_and_extract_keep_rows_quantized(bits: int) -> None:
    model = fresh_model("nemotron_h")
    use_kv_bits(model, bits)
    a, b = model.make_cache(1), model.make_cache(1)
    model(mx.array([[4, 5, 6]], dtype=mx.int32), a)
    model(mx.array([[7, 8, 9, 10, 11]], dtype=mx.int32), b)
    merged = HybridCache.merge([a, b])
    back = merged.extract(1)
    assert back.offsets == [5]
    for one, two in zip(b.layers, back.layers, strict=True):
        if isinstance(one, QuantizedKVCache):
            assert isinstance(two, QuantizedKVCache) and two.bits == bits
            assert all(
                mx.array_equal(x[:, :, :5], y[:, :, :5]).item()
                for x, y in zip(one.slots(), two.slots(), strict=True)
            )


def test_bits_and_head_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="kv_bits"):
        EngineConfig(kv_bits=3)
    with pytest.raises(ValueError, match="head of 16"):
        use_kv_bits(_nemotron_with_16_heads(), 8)


def _nemotron_with_16_heads():
    from engine_standins import tiny_model

    return tiny_model("nemotron_h")


# -- the engine ---------------------------------------------------------------------------------

PROMPTS = [
    "def add(x, y):\n    return x + y\n\ndef add(x, y):\n",
    "abc abc abc abc",
    "The quick brown fox. The quick brown fox. The quick",
]


def _client(model, decode=None, **cfg) -> InProcessEngine:
    info = ModelInfo(id="tiny", family="test", context_length=4096, max_output_tokens=1024)
    cfg.setdefault("prefill_chunk", 64)
    return InProcessEngine(
        model, ByteTokenizer(), info, eos_token_ids={EOS}, config=EngineConfig(**cfg), decode=decode
    )


async def _greedy(client, prompt: str, n: int = 20) -> list[int]:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    ids: list[int] = []
    async for event in client.generate(GenerationRequest(prompt=prompt, sampling=params)):
        if isinstance(event, TokenEvent):
            ids += event.token_ids
    return ids


async def _alone_and_batched(model, decode=None, **cfg) -> tuple[list[list[int]], list[list[int]]]:
    client = _client(model, decode, prefix_cache_bytes=0, **cfg)
    try:
        alone = [await _greedy(client, p) for p in PROMPTS]
        together = await asyncio.gather(*(_greedy(client, p) for p in PROMPTS))
    finally:
        client.close()
    return alone, list(together)


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
@BITS
async def test_speculative_and_batched_equal_plain_with_quantized_kv(kind: str, bits: int) -> None:
    model = fresh_model(kind)
    plain, batched = await _alone_and_batched(model, kv_bits=bits)
    assert batched == plain
    refs = {tuple(ByteTokenizer().encode(p)): ids for p, ids in zip(PROMPTS, plain, strict=True)}
    tree = make_decode_strategy("draft", draft_model=fresh_model(kind), draft_tokens=4, tree=True)
    strategies = [SpeculativeDecode(lambda: OracleDrafter(refs, seed=1), max_draft=5, adaptive=False), tree]
    for strategy in strategies:
        strategy.adaptive = False  # verify every draft: rollback / commit_path on every step
        alone, together = await _alone_and_batched(model, strategy, kv_bits=bits)
        assert alone == plain and together == plain, strategy.name
        assert strategy.stats.proposed > 0


@BITS
async def test_prefix_and_disk_tiers_hold_quantized_kv(bits: int, tmp_path) -> None:
    model = fresh_model("qwen3_5")
    cold = await replay(_client(model, prefix_cache_bytes=0, kv_bits=bits), 3)
    first = _client(model, kv_bits=bits, disk_cache_dir=tmp_path, model_key="q")
    warm = await replay(first, 3)
    first.close()
    assert [ids for ids, _ in warm] == [ids for ids, _ in cold]
    assert all(usage.cached_tokens > 0 for _, usage in warm[1:])
    files = sorted(tmp_path.rglob("*.safetensors"))
    kinds = {info["dtype"] for f in files for name, info in read_header(f).items() if name.startswith("kv.")}
    assert files and kinds == {"U32", "F32"}  # packed words, float32 scales and biases (the CPU's dtype)
    # a restarted engine resumes from the quantized files; another bit width keeps off them
    again = _client(model, kv_bits=bits, disk_cache_dir=tmp_path, model_key="q")
    assert (await replay(again, 1))[0][1].cached_tokens > 0
    again.close()
    other = _client(model, kv_bits=12 - bits, disk_cache_dir=tmp_path, model_key="q")
    assert (await replay(other, 1))[0][1].cached_tokens == 0
    assert other.stats().corrupt_checkpoints_deleted == 0 and all(f.exists() for f in files)
    other.close()
