"""What `--kv-bits 8` and `4` cost in quality on a trained checkpoint (issue #29): logits with the
attention K/V stored quantized against the same model with K/V as computed, teacher-forced over
held-out Python files, and greedy continuations of the same prompts.

    .venv/bin/python lab/kv_bits_quality.py                       # the demo checkpoint, on any machine
    python lab/kv_bits_quality.py --model /path/to/checkpoint --tokens 4096

Per bit width: the largest logit error relative to the largest logit, the mean KL divergence from
the float K/V's next-token distribution (nats), the share of positions whose greedy token agrees,
the K/V bytes per token measured from the cache's arrays, and for greedy decoding the share of
generated tokens equal to the float K/V's run and where the first difference falls. Held-out files:
the demo never trained on them (tools/tinyckpt/corpus.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from tinyckpt.corpus import read_stdlib, split_files  # noqa: E402

from kapitsa.engine.cache.layers import KVCache  # noqa: E402
from kapitsa.engine.cache.quantized_kv import QuantizedKVCache, use_kv_bits  # noqa: E402
from kapitsa.engine.loading.loader import load_model  # noqa: E402

CHUNK = 256


def texts(count: int) -> list[str]:
    _, held_out = split_files(read_stdlib())
    return [f.text for f in held_out if len(f.text) > 4000][:count]


def teacher_forced(model, tokens: list[int], bits: int | None) -> tuple[mx.array, int]:
    """Logits [T, V] float32 of every position, and the K/V bytes the cache holds per token."""
    use_kv_bits(model, bits)
    cache = model.make_cache(1)
    ids = mx.array([tokens], dtype=mx.int32)
    rows = []
    for start in range(0, len(tokens), CHUNK):
        rows.append(model(ids[:, start : start + CHUNK], cache)[0].astype(mx.float32))
        mx.eval(rows[-1])
    use_kv_bits(model, None)
    kv = [c for c in cache.layers if isinstance(c, KVCache | QuantizedKVCache)]
    stored = sum(sum(a.nbytes for a in c.slots()) for c in kv)
    capacity = kv[0].slots()[0].shape[2] if kv else 1
    return mx.concatenate(rows), stored // capacity


def greedy(model, prompt: list[int], steps: int, bits: int | None) -> list[int]:
    use_kv_bits(model, bits)
    cache = model.make_cache(1)
    logits = model(mx.array([prompt], dtype=mx.int32), cache)[0, -1]
    out = []
    for _ in range(steps):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = model(mx.array([[token]], dtype=mx.int32), cache)[0, -1]
    use_kv_bits(model, None)
    return out


def mlxlm_teacher_forced(model, tokens: list[int], bits: int | None) -> mx.array:
    """The same with mlx-lm's model and caches (its QuantizedKVCache for the attention layers)."""
    from mlx_lm.models.cache import KVCache as LmKVCache
    from mlx_lm.models.cache import QuantizedKVCache as LmQuantized
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if bits is not None:
        cache = [LmQuantized(group_size=64, bits=bits) if type(c) is LmKVCache else c for c in cache]
    ids = mx.array([tokens], dtype=mx.int32)
    rows = []
    for start in range(0, len(tokens), CHUNK):
        rows.append(model(ids[:, start : start + CHUNK], cache=cache)[0].astype(mx.float32))
        mx.eval(rows[-1])
    return mx.concatenate(rows)


def compare(ref: mx.array, got: mx.array) -> dict:
    error = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
    log_p, log_q = (x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (ref, got))
    kl = (mx.exp(log_p) * (log_p - log_q)).sum(axis=-1).mean().item()
    agreement = (got.argmax(-1) == ref.argmax(-1)).mean().item()
    return dict(logit_error=round(error, 5), mean_kl_nats=round(kl, 6), greedy_agreement=round(agreement, 4))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "kapitsa" / "demo"))
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="teacher-forced tokens per file")
    parser.add_argument("--generate", type=int, default=128, help="greedy tokens after a 512-token prompt")
    parser.add_argument("--mlx-lm", action="store_true", help="also mlx-lm's quantized K/V on the same files")
    args = parser.parse_args()
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    lm_model = None
    if args.mlx_lm:
        import tempfile

        from mlx_lm import load

        from lab.cpu_vs_mlxlm import _mlxlm_folder

        with tempfile.TemporaryDirectory() as scratch:
            lm_model, _ = load(str(_mlxlm_folder(Path(args.model), Path(scratch))))
    for n, text in enumerate(texts(args.files)):
        tokens = tokenizer.encode(text)[: args.tokens]
        if lm_model is not None:
            lm_ref = mlxlm_teacher_forced(lm_model, tokens, None)
            for bits in (8, 4):
                row = compare(lm_ref, mlxlm_teacher_forced(lm_model, tokens, bits))
                print(
                    json.dumps(dict(engine="mlx-lm", file=n, tokens=len(tokens), bits=bits, **row)),
                    flush=True,
                )
        ref, float_bytes = teacher_forced(model, tokens, None)
        base = greedy(model, tokens[:512], args.generate, None)
        for bits in (8, 4):
            got, nbytes = teacher_forced(model, tokens, bits)
            run = greedy(model, tokens[:512], args.generate, bits)
            same = sum(a == b for a, b in zip(base, run, strict=True)) / len(base)
            first = next((i for i, (a, b) in enumerate(zip(base, run, strict=True)) if a != b), None)
            row = dict(engine="kapitsa", file=n, tokens=len(tokens), bits=bits, **compare(ref, got))
            row |= dict(kv_bytes_per_token=nbytes, of_float=round(nbytes / float_bytes, 3))
            row |= dict(generated_equal=round(same, 3), first_difference=first)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
