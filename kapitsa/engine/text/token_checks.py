"""Token ids from outside checked before they reach MLX: an id outside the embedding's rows crashes
the process (out of bounds gather), a negative one wraps around, one beyond int32 fails the cast."""

from __future__ import annotations

from collections.abc import Sequence

from kapitsa.engine.types import GenerationRequest
from kapitsa.errors import InvalidRequest

INT32_LIMIT = 2**31  # without a known vocabulary, ids must still fit MLX's int32 token arrays


def model_vocab_size(model: object) -> int | None:
    """The rows of a kapitsa model's embedding (`args.vocab_size`), or None when it does not say."""
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def check_token_ids(ids: Sequence[int], vocab_size: int | None, *, where: str) -> None:
    """Raise `InvalidRequest` unless every id is an int (not a bool) in [0, vocab_size)."""
    limit = vocab_size or INT32_LIMIT
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < limit):
        return
    bad = next(i for i in ids if type(i) is not int or not 0 <= i < limit)
    raise InvalidRequest(
        f"{where} holds {bad!r}, which is no token id: ids are integers from 0 to {limit - 1}"
    )


def check_request_token_ids(
    request: GenerationRequest, prompt_ids: list[int], vocab_size: int | None
) -> None:
    """Every token id a request carries: its prompt (given or tokenized), logit biases and stop ids."""
    check_token_ids(prompt_ids, vocab_size, where="the prompt")
    check_token_ids([i for i, _ in request.sampling.logit_bias], vocab_size, where="logit_bias")
    check_token_ids(request.sampling.stop_token_ids, vocab_size, where="stop_token_ids")
