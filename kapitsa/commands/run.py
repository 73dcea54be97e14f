"""`kapitsa run`: open an engine, generate from one prompt, stream the answer or print one JSON object."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kapitsa.commands.group import join_as_rank, launched_rank, leave, relaunch, wants_group
from kapitsa.engine.options import DEFAULT_SPECULATIVE
from kapitsa.errors import InvalidRequest, KapitsaError


@dataclass(slots=True, frozen=True)
class RunOptions:
    model: str | None
    prompt: str | None = None
    prompt_file: Path | None = None
    prompt_arg: str | None = None
    raw: bool = False
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None
    json_out: bool = False
    speculative: str | None = None  # None: the default mode
    draft: str | None = None
    draft_tokens: int | None = None
    tree: bool | None = None  # None: the tuned draft shape, else a chain
    kv_bits: str | None = None  # --kv-bits: "8", "4", "auto"; None: off
    images: tuple[Path, ...] = ()  # --image, in order, before the prompt's text
    hostfile: Path | None = None  # --hostfile: the model across mlx.launch's hosts (commands/group.py)
    parallel: str = "pipeline"  # --parallel: how the group splits the model


@dataclass(slots=True, frozen=True)
class RunResult:
    model: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    finish_reason: str
    prefill_tok_s: float
    decode_tok_s: float
    tokens_per_step: float = 0.0  # the engine's speculative decoding, per decode step (0: none)


def read_prompt(options: RunOptions) -> str:
    """The one prompt given as an argument, `--prompt` or `--prompt-file` ("-" reads stdin)."""
    given = [p for p in (options.prompt_arg, options.prompt) if p is not None]
    if options.prompt_file is not None:
        try:
            given.append(
                sys.stdin.read()
                if str(options.prompt_file) == "-"
                else options.prompt_file.read_text("utf-8")
            )
        except (OSError, UnicodeDecodeError) as err:
            raise InvalidRequest(f"cannot read the prompt file {options.prompt_file}: {err}") from err
    if len(given) != 1:
        raise InvalidRequest("give exactly one prompt: an argument, --prompt TEXT or --prompt-file FILE")
    if not given[0]:
        raise InvalidRequest("the prompt is empty")
    return given[0]


def cmd_run(options: RunOptions, *, write: Callable[[str], object] | None = None) -> RunResult:
    """Run one generation; stream text through `write` (stdout) unless `--json`, then print JSON."""
    from kapitsa.opener import open_engine

    out = write or _stdout_write
    if wants_group(options.hostfile):
        return _run_in_group(options, out)
    request = make_request(read_prompt(options), options)  # bad flags fail before the weights load
    engine = open_engine(
        options.model,
        speculative=options.speculative or DEFAULT_SPECULATIVE,
        draft=options.draft,
        draft_tokens=options.draft_tokens,
        tree=options.tree,
        kv_bits=options.kv_bits,
    )
    with contextlib.closing(engine) as client:
        if request.images and not client.models()[0].vision:
            raise InvalidRequest(f"--image: {client.models()[0].id} reads text only (it has no vision tower)")
        result = asyncio.run(generate(client, request, None if options.json_out else out))
    if options.json_out:
        out(json.dumps(asdict(result), ensure_ascii=False) + "\n")
    else:
        out("\n")
    return result


def _run_in_group(options: RunOptions, out: Callable[[str], object]) -> RunResult | None:
    """Rank 0 reads the prompt, generates and prints; the other ranks run its steps and print nothing
    (nor read the prompt: its file may exist only where rank 0 runs)."""
    from kapitsa.opener import check_group_flags, open_group_engine

    check_group_flags(
        parallel=options.parallel,
        speculative=options.speculative,
        draft=options.draft,
        kv_bits=options.kv_bits,
        model=options.model,
        tree=options.tree,
    )
    if options.images:
        raise InvalidRequest("a distributed model reads text only: leave --image out")
    if options.prompt_file is not None and str(options.prompt_file) == "-":
        raise InvalidRequest(
            "the ranks of a group do not read stdin: give the prompt as an argument or a file"
        )
    if launched_rank() is None:
        make_request(read_prompt(options), options)  # a bad prompt fails before any rank starts
        relaunch(options.hostfile, sys.argv[1:])
    join_as_rank()
    request = make_request(read_prompt(options), options) if launched_rank() == 0 else None
    engine = open_group_engine(
        options.model,
        parallel=options.parallel,
        speculative=options.speculative,
        draft_tokens=options.draft_tokens,
    )
    if engine is None:
        leave(0)
    with contextlib.closing(engine) as client:
        result = asyncio.run(generate(client, request, None if options.json_out else out))
    out(json.dumps(asdict(result), ensure_ascii=False) + "\n" if options.json_out else "\n")
    leave(0)


def make_request(text: str, options: RunOptions):  # noqa: ANN201 - GenerationRequest
    from kapitsa.engine.types import GenerationRequest, SamplingParams

    try:
        sampling = SamplingParams(
            temperature=options.temperature, seed=options.seed, max_tokens=options.max_tokens
        )
    except ValueError as err:
        raise InvalidRequest(str(err)) from err
    if options.raw:
        if options.images:
            raise InvalidRequest("--image needs the chat template (it places the image tokens): drop --raw")
        return GenerationRequest(prompt=text, sampling=sampling)
    if not options.images:
        return GenerationRequest(messages=({"role": "user", "content": text},), sampling=sampling)
    content = [{"type": "image"} for _ in options.images] + [{"type": "text", "text": text}]
    return GenerationRequest(
        messages=({"role": "user", "content": content},),
        images=tuple(read_image(path) for path in options.images),
        sampling=sampling,
    )


def read_image(path: Path) -> bytes:
    """An image file's bytes, checked to be an image Pillow reads (a bad file fails before the
    weights load; the engine decodes it again for the model)."""
    from PIL import Image, UnidentifiedImageError

    try:
        data = path.read_bytes()
    except OSError as err:
        raise InvalidRequest(f"cannot read the image {path}: {err.strerror or err}") from err
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise InvalidRequest(f"{path}: the image could not be decoded: {err}") from err
    return data


async def generate(client, request, on_text: Callable[[str], object] | None) -> RunResult:  # noqa: ANN001
    """Drive one request through an `EngineClient`, streaming text; raises the stream's error."""
    from kapitsa.engine.types import ErrorEvent, FinishEvent, TokenEvent

    parts: list[str] = []
    ids: list[int] = []
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            parts.append(event.text)
            ids.extend(event.token_ids)
            if on_text is not None and event.text:
                on_text(event.text)
        elif isinstance(event, ErrorEvent):
            raise event.error
        elif isinstance(event, FinishEvent):
            per_step = client.stats().tokens_per_step
            return _result(client.models()[0].id, "".join(parts), ids, event, per_step)
    raise KapitsaError("the engine ended the stream without finishing it")


def _result(model: str, text: str, ids: list[int], finish, tokens_per_step: float) -> RunResult:  # noqa: ANN001
    usage = finish.usage
    computed = usage.prompt_tokens - usage.cached_tokens
    # the first token comes out of the prefill; decode speed counts the tokens after it
    decoded = max(usage.completion_tokens - 1, 0)
    return RunResult(
        model=model,
        text=text,
        token_ids=ids,
        prompt_tokens=usage.prompt_tokens,
        generation_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        finish_reason=finish.finish_reason,
        prefill_tok_s=round(computed / usage.prefill_seconds, 2) if usage.prefill_seconds > 0 else 0.0,
        decode_tok_s=round(decoded / usage.decode_seconds, 2) if usage.decode_seconds > 0 else 0.0,
        tokens_per_step=round(tokens_per_step, 3),
    )


def _stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
