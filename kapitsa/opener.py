"""Opening an engine for a model reference: the one place `kapitsa run`, `serve`, `bench` and the TUI
get theirs, so every surface resolves references, caches prompts and speculates the same way.

The engine is imported inside the functions (it loads MLX); an engine missing from this build is a
`NotBuilt` error that says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kapitsa.engine.options import DEFAULT_SPECULATIVE, SPECULATIVE_MODES, EngineConfig, KernelOptions
from kapitsa.errors import InvalidRequest, KapitsaError, ModelNotFound, NotBuilt, NotDownloaded
from kapitsa.kv_fit import parse_kv_bits, resolve_kv_bits
from kapitsa.settings import KapitsaSettings, load_settings

if TYPE_CHECKING:
    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.loading.loader import LoadedModel


def open_engine(
    ref: str | None,
    *,
    speculative: str = DEFAULT_SPECULATIVE,
    draft: str | None = None,
    draft_tokens: int | None = None,
    tree: bool | None = None,
    settings: KapitsaSettings | None = None,
    kv_bits: str | int | None = None,
    warm_batches: bool = False,
) -> InProcessEngine:
    """Load a model and start its engine thread; the caller closes it (`contextlib.closing`).

    Args:
        ref: a catalog alias (`27b`, `27b:6bit`, `demo`), folder, .gguf file or cached HF repo id;
            None: the settings' default model.
        speculative: the `--speculative` mode (factory.MODES); `draft`, `draft_tokens` and `tree`
            are its `--draft`, `--draft-tokens` and `--tree` flags. With neither `draft_tokens` nor
            `tree` given, the draft shape `kapitsa bench --tune-speculation` measured fastest for
            this model and backend applies (a chain of up to 7 tokens when none was measured).
        settings: the user settings (default: read them); the disk tier lives in their state folder.
        kv_bits: the `--kv-bits` flag: 8 or 4 (quantized attention K/V), "auto" (doctor's fit
            picks for this machine) or None (the activation dtype).
        warm_batches: have the idle engine make every decode batch size ready on a GPU before a
            burst of concurrent requests first forms it, and its prefill chunk lengths before a
            first prompt needs them (a server; runner/warmup.py).
    Returns:
        The running engine, an `EngineClient` with a `close()`.
    Raises:
        KapitsaError: the reference, the flags or the checkpoint cannot be opened.
    """
    settings = settings or load_settings()
    keep_jit_cache(settings.state_dir)
    check_speculation(speculative, draft)
    kv_choice = parse_kv_bits(kv_bits)
    config = engine_config(settings)
    loaded = load_for_ref(ref, settings=settings)
    config = dataclasses.replace(
        config,
        kv_bits=resolve_kv_bits(kv_choice, loaded.path),
        warm_batches=None if warm_batches else (),
        warm_prefill=None if warm_batches else (),
    )
    if tree is None and draft_tokens is None and speculative != "none":
        tuned = read_tuned(loaded, settings)
        if tuned is not None:
            tree, draft_tokens = tuned.shape.tree, tuned.shape.draft_tokens
            if speculative == "auto" and not tuned.pays:
                speculative = "none"  # the bench measured every draft shape slower than plain here
    return start_engine(
        loaded,
        config,
        speculative=speculative,
        draft=draft_source(draft, settings),
        draft_tokens=draft_tokens,
        tree=bool(tree),
    )


def hand_back_memory() -> None:
    """After an engine closed and its client is out of reach: free what its model, caches and
    steps held (their reference cycles) and empty MLX's buffer cache, so the device memory goes
    back to other processes, such as a server a bench times next on the same device."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


def draft_source(draft: str | None, settings: KapitsaSettings) -> str | None:
    """`--draft` as the loader takes it: a catalog alias (`4b`, `demo`) becomes its folder or repo id;
    a folder, file or repo id stays as given."""
    from kapitsa.catalog import is_alias, load_catalog, resolve_model

    if draft is None:
        return None
    catalog = load_catalog(settings.catalog)
    if not is_alias(draft, catalog):  # an alias wins over a folder of its name, as for --model
        return draft
    resolved = resolve_model(draft, catalog)
    if resolved.quantize is not None:
        raise KapitsaError(
            f"--draft {draft} is quantized on load, which a drafter does not do: pass a ready-quantized alias or a folder"
        )
    return resolved.source


def keep_jit_cache(state_dir: Path, environ: dict[str, str] | None = None) -> Path | None:
    """On MLX's CUDA backend, point MLX's cache of JIT-compiled kernels at kapitsa's state folder
    (unless `MLX_PTX_CACHE_DIR` is set): its default is the temp folder, which a reboot empties, and
    a fresh cache costs the first request about a minute of NVRTC compiles on an H200 (MLX's own
    quantized matmuls; lab/runs/batch-compile-4b-h200-s19.log). One folder per MLX version and GPU
    architecture, as compiled cubins fit only those. Returns the folder, or None where unchanged.
    Runs before the model loads: MLX reads the variable at its first compile."""
    environ = os.environ if environ is None else environ
    if "MLX_PTX_CACHE_DIR" in environ:
        return None
    with _engine_required():
        import mlx.core as mx
    if not mx.cuda.is_available():
        return None
    try:
        arch = str(mx.device_info().get("architecture", "cuda"))
    except Exception:  # noqa: BLE001 - a build without the query: one folder for this MLX version
        arch = "cuda"
    folder = (
        state_dir
        / "jit-cache"
        / f"mlx-{mx.__version__}"
        / "".join(c for c in arch if c.isalnum() or c in "._-")
    )
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return None  # an unwritable state folder: MLX keeps its default
    environ["MLX_PTX_CACHE_DIR"] = str(folder)
    return folder


def start_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    *,
    speculative: str,
    draft: str | None = None,
    draft_tokens: int | None = None,
    tree: bool = False,
) -> InProcessEngine:
    """The engine thread for an already loaded model (the bench starts several over one load)."""
    with _engine_required():
        from kapitsa.engine.inprocess import InProcessEngine
        from kapitsa.engine.speculative.factory import strategy_for
    decode = strategy_for(
        speculative,
        target_model=loaded.model,
        draft=draft,
        draft_tokens=draft_tokens,
        tree=tree,
        kernels=config.kernels,  # a draft model runs the kernels the target does
    )
    return InProcessEngine.from_loaded(loaded, config=config, decode=decode)


def tuning_path(settings: KapitsaSettings) -> Path:
    with _engine_required():
        from kapitsa.engine.speculative.tuning import TUNING_FILE
    return settings.state_dir / TUNING_FILE


def tuning_key_for(loaded: LoadedModel) -> str:
    """The tuning file's key: the model and the backend it runs on (the fastest shape differs)."""
    with _engine_required():
        from kapitsa.engine.kernels import backend
        from kapitsa.engine.speculative.tuning import tuning_key
    return tuning_key(loaded.info.id, backend())


def read_tuned(loaded: LoadedModel, settings: KapitsaSettings):  # noqa: ANN201 - tuning.Tuning | None
    with _engine_required():
        from kapitsa.engine.speculative.tuning import read_tuning
    return read_tuning(tuning_path(settings), tuning_key_for(loaded))


def engine_config(settings: KapitsaSettings) -> EngineConfig:
    """The engine's options: the prefix cache with its disk tier, kernels from the `KAPITSA_*` lab variables."""
    try:
        kernels = KernelOptions.from_environ(os.environ)  # the one read of the environment
    except ValueError as err:
        raise InvalidRequest(f"kernel options: {err}") from err
    # The disk tier lives in kapitsa's state folder, so a prompt cached by one run or server serves the next.
    return EngineConfig(disk_cache_dir=settings.state_dir / "prefix-cache", kernels=kernels)


def load_for_ref(ref: str | None, *, settings: KapitsaSettings | None = None) -> LoadedModel:
    """Load a catalog alias ("27b", "27b:6bit", "demo"), a folder, a .gguf file or a cached HF repo id."""
    from kapitsa.catalog import is_alias, load_catalog, resolve_model

    settings = settings or load_settings()
    ref = ref or settings.default_model
    with _engine_required():
        from kapitsa.engine.loading.loader import load_model
    catalog = load_catalog(settings.catalog)
    if not is_alias(ref, catalog):
        try:  # load_model handles paths, repo ids and ":4bit"-style tags
            return load_model(ref, memory_budget=small_budget(ref))
        except NotDownloaded:
            raise
        except ModelNotFound:
            resolve_model(
                ref, catalog
            )  # neither a path nor a repo id: the catalog's message, naming its aliases
            raise
    resolved = resolve_model(ref, catalog)
    source = resolved.source
    try:
        return load_model(
            str(source),
            model_id=resolved.display_name,
            quantize=resolved.quantize,
            memory_budget=small_budget(ref),
        )
    except NotDownloaded:
        raise NotDownloaded(
            f"{ref} ({resolved.repo_id}) is not downloaded yet: run `kapitsa pull {ref}`", ref=ref
        ) from None


def small_budget(ref: str) -> int | None:
    """doctor's memory budget for a `:small` reference (it picks the recipe's widths); None otherwise."""
    from kapitsa.engine.loading.model_ref import parse_model_ref

    if parse_model_ref(ref).quantization != "small":
        return None
    from kapitsa.doctor import probe_hardware

    return probe_hardware().usable_memory_bytes or None


def check_speculation(mode: str, draft: str | None) -> None:
    """Refuse speculative flags that cannot be set up, before minutes of loading weights."""
    with _engine_required():
        from kapitsa.engine.speculative.factory import MODES

    if mode not in MODES:
        raise KapitsaError(f"unknown speculative mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode in ("draft", "block") and not draft:
        raise KapitsaError(
            f"--speculative {mode} needs --draft (a catalog alias, folder or repo id of a drafter)"
        )


@contextlib.contextmanager
def _engine_required() -> Iterator[None]:
    """Around the engine's imports only: a build without it (or without MLX) says so."""
    try:
        yield
    except ImportError as err:
        raise NotBuilt(f"the in-process engine is not available in this build ({err})") from err


def check_group_flags(
    *,
    parallel: str,
    speculative: str | None,
    draft: str | None,
    kv_bits: str | None,
    model: str | None = None,
    tree: bool | None = None,
) -> None:
    """Refuse what a distributed group does not run, before any process is launched."""
    with _engine_required():
        from kapitsa.engine.distributed.group import PARALLEL_MODES
        from kapitsa.engine.distributed.speculation import GROUP_SPECULATIVE_MODES
    if parallel not in PARALLEL_MODES:
        raise InvalidRequest(f"unknown --parallel {parallel!r}; choose one of {', '.join(PARALLEL_MODES)}")
    if speculative is not None and speculative not in GROUP_SPECULATIVE_MODES:
        if speculative not in SPECULATIVE_MODES:
            raise InvalidRequest(
                f"unknown speculative mode {speculative!r}; choose one of {', '.join(SPECULATIVE_MODES)}"
            )
        raise InvalidRequest(
            f"--speculative {speculative} does not run across a group yet: a group drafts by n-gram "
            "lookup (--speculative auto or ngram) or not at all (none)"
        )
    if draft is not None:
        raise InvalidRequest("--draft does not run across a group yet: a group drafts by n-gram lookup")
    if tree:
        raise InvalidRequest("--tree does not run across a group yet: a group verifies a chain of drafts")
    if kv_bits not in (None, "off"):
        raise InvalidRequest("--kv-bits does not run across a group yet: leave it out")
    if model is not None and _is_small(model):
        raise InvalidRequest(
            "the ':small' recipe does not run across a group yet: load a quantized checkpoint"
        )


def on_group_hard_exit(hook: Callable[[int], None]) -> None:
    """Call `hook(code)` before a rank leaves at once (a lost peer, a stuck step), which skips atexit."""
    with _engine_required():
        from kapitsa.engine.distributed.group import EXIT_HOOKS
    EXIT_HOOKS.append(hook)


def _is_small(ref: str) -> bool:
    from kapitsa.engine.loading.model_ref import parse_model_ref

    try:
        return parse_model_ref(ref).quantization == "small"
    except KapitsaError:
        return False  # opening it says what is wrong


def open_group_engine(  # noqa: ANN201 - GroupEngine | None
    ref: str | None,
    *,
    parallel: str,
    settings: KapitsaSettings | None = None,
    speculative: str | None = None,
    draft_tokens: int | None = None,
):
    """This process's rank of a group that mlx.launch started: load its shard of the model.

    `speculative` ("auto", "ngram" or "none"; None: the default, n-gram drafting) and
    `draft_tokens` (the longest draft) set rank 0's speculation (check_group_flags refuses others).

    Returns:
        On rank 0 the group's engine, an `EngineClient` whose `close()` stops every rank; on the
        other ranks None, after rank 0 has stopped the group (they run its steps until then).
    Raises:
        KapitsaError: the reference cannot be opened, the group cannot form, or the model cannot
            be split this way.
    """
    from kapitsa.catalog import is_alias, load_catalog, resolve_model

    settings = settings or load_settings()
    keep_jit_cache(settings.state_dir)
    ref = ref or settings.default_model
    with _engine_required():
        from kapitsa.engine.distributed.start import start_rank
    catalog = load_catalog(settings.catalog)
    source, model_id = ref, None
    if is_alias(ref, catalog):
        resolved = resolve_model(ref, catalog)
        source = resolved.source
        model_id = resolved.display_name
        if resolved.quantize is not None:  # a recipe on load (':small'): not split across ranks yet
            raise InvalidRequest(f"{ref}: the ':{resolved.quantize}' recipe does not run across a group yet")
    config = engine_config(settings)
    return start_rank(
        source,
        parallel=parallel,
        model_id=model_id,
        kernels=config.kernels,
        speculative=speculative,
        draft_tokens=draft_tokens,
        prefix_cache_bytes=config.prefix_cache_bytes,
    )


def gather_over_group(values: list[int]) -> tuple[int, list[list[int]]]:
    """In a group mlx.launch started: (this rank, every rank's `values` in rank order)."""
    with _engine_required():
        from kapitsa.engine.distributed.group import gather_ints, init_group
    group = init_group()
    return group.rank, gather_ints(group, values)
