"""A request as rank 0 of a group runs it: its prompt rendered and checked, a `Sequence` to decode."""

from __future__ import annotations

from kapitsa.engine.runner.memory import check_context
from kapitsa.engine.runner.sequence import Sequence
from kapitsa.engine.runner.stop import StopMatcher
from kapitsa.engine.text.prepare import prediction_ids, prepare_prompt
from kapitsa.engine.text.prompt_encoder import PromptEncoder
from kapitsa.engine.text.token_checks import check_request_token_ids
from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.engine.types import GenerationRequest, ModelInfo
from kapitsa.errors import InvalidRequest


def make_sequence(
    request: GenerationRequest, *, tokenizer: Tokenizer, encoder: PromptEncoder, info: ModelInfo
) -> Sequence:
    """The request's sequence, its message boundaries marked for the prefix cache.

    Raises:
        InvalidRequest: what a group does not serve (n > 1, a grammar), an empty prompt, bad token ids.
        ContextOverflow: a prompt that leaves no room to generate.
    """
    if request.n != 1 or request.sampling.constraint is not None:
        raise InvalidRequest("a distributed model serves one choice per request, without a grammar")
    prepared = prepare_prompt(tokenizer, request, encode=encoder.encode)
    if not prepared.ids:
        raise InvalidRequest("the prompt is empty")
    check_request_token_ids(request, prepared.ids, info.vocab_size)
    check_context(len(prepared.ids), info.context_length)
    room = info.context_length - len(prepared.ids)
    wanted = request.sampling.max_tokens
    max_tokens = min(room, info.max_output_tokens if wanted is None else wanted)
    predicted = ()
    if request.prediction:  # a predicted output: rank 0's drafter copies from it
        window, longest = info.context_length, info.max_token_bytes
        predicted = prediction_ids(tokenizer.encode, request.prediction, window=window, longest=longest)
    return Sequence(
        prediction_ids=predicted,
        request=request,
        prompt_ids=prepared.ids,
        boundaries=prepared.boundaries,
        emit=lambda _event: None,
        sampler=None,  # made on the engine thread (it holds MLX arrays)
        detokenizer=tokenizer.detokenizer(),
        stop=StopMatcher(request.sampling.stop),
        max_tokens=max(1, max_tokens),
        eos_ids=frozenset(tokenizer.eos_token_ids),
        token_text=lambda token_id: tokenizer.decode([token_id]),
    )
