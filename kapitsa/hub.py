"""Downloads into the standard Hugging Face cache (shared with mlx-lm, transformers, LM Studio's HF mode).

`pull` resolves a catalog alias or repo id, lists the repo's files at one commit (huggingface_hub's API
client), downloads each file into the cache's own layout, and checks it against the hub's hashes
(sha256 for LFS files, the git blob id otherwise) before it becomes visible. Downloads resume: an
interrupted file keeps its `.incomplete` part, which the next pull continues with a Range request
(huggingface_hub itself discards partial files since 1.x, hence the own download loop). `HF_ENDPOINT`, `HF_TOKEN` and `HF_HUB_OFFLINE` are honoured. Nothing prints:
progress goes to a callback as `PullProgress` values.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import httpx
from filelock import FileLock
from huggingface_hub import HfApi, constants, hf_hub_url, scan_cache_dir
from huggingface_hub.errors import (
    CacheNotFound,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import build_hf_headers

from kapitsa.catalog import Catalog, ResolvedModel, resolve_model
from kapitsa.errors import AuthError, CheckpointError, KapitsaError, ModelNotFound


@dataclass(slots=True, frozen=True)
class PullProgress:
    repo_id: str
    file_name: str
    files_done: int
    files_total: int
    bytes_done: int  # all files, including the current one's progress
    bytes_total: int


@dataclass(slots=True, frozen=True)
class PullResult:
    ref: str
    repo_id: str
    commit: str
    path: Path  # the snapshot folder to load
    num_files: int
    num_bytes: int
    downloaded_bytes: int  # 0 when everything was already in the cache


@dataclass(slots=True, frozen=True)
class LocalModel:
    repo_id: str
    refs: tuple[str, ...]  # catalog aliases that point at this repo
    size_bytes: int
    path: Path  # the newest snapshot
    commits: tuple[str, ...]
    last_modified: float


@dataclass(slots=True, frozen=True)
class RemoveResult:
    repo_id: str
    freed_bytes: int


@dataclass(slots=True, frozen=True)
class _RemoteFile:
    path: str
    size: int
    blob_id: str
    sha256: str | None  # LFS files only


ProgressCallback = Callable[[PullProgress], None]


def _network_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub 2.x speaks through its own httpx fork (httpx2); kapitsa's downloads use httpx."""
    errors: list[type[BaseException]] = [httpx.HTTPError]
    try:
        import httpx2  # type: ignore[import-not-found]

        errors.append(httpx2.HTTPError)
    except ImportError:
        pass
    return tuple(errors)


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def _cache_root(cache_dir: Path | None) -> Path:
    """The HF cache kapitsa reads and writes (HF_HOME / HF_HUB_CACHE honoured), looked up at call time."""
    return Path(cache_dir or constants.HF_HUB_CACHE)


def _offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in (
        "1",
        "true",
        "yes",
    )


def pull(
    ref: str, *, catalog: Catalog, cache_dir: Path | None = None, on_progress: ProgressCallback | None = None
) -> PullResult:
    """Download (or find in the cache) the model `ref` names and verify every file."""
    model = resolve_model(ref, catalog)
    if model.kind == "path":
        assert model.path is not None
        return PullResult(
            ref=ref,
            repo_id=str(model.path),
            commit="",
            path=model.path,
            num_files=0,
            num_bytes=0,
            downloaded_bytes=0,
        )
    assert model.repo_id is not None
    if _offline():
        return _cached_result(model, cache_dir)
    with _translate_hub_errors(model.repo_id):
        api = HfApi(endpoint=_endpoint())
        commit = api.model_info(model.repo_id).sha
        if not commit:
            raise KapitsaError(f"the hub did not report a commit for {model.repo_id}")
        files = _remote_files(api, model, commit)
        return _download_all(model, commit, files, cache_dir, on_progress)


def _remote_files(api: HfApi, model: ResolvedModel, commit: str) -> list[_RemoteFile]:
    files = []
    for entry in api.list_repo_tree(model.repo_id, revision=commit, recursive=True):  # type: ignore[arg-type]
        if not hasattr(entry, "blob_id"):
            continue  # a folder
        if model.allow_patterns and not any(fnmatch(entry.path, p) for p in model.allow_patterns):
            continue
        sha256 = entry.lfs.sha256 if entry.lfs is not None else None
        files.append(_RemoteFile(path=entry.path, size=entry.size, blob_id=entry.blob_id, sha256=sha256))
    if not files:
        raise ModelNotFound(f"{model.repo_id} has no files matching {list(model.allow_patterns or ['*'])}")
    return files


def _download_all(
    model: ResolvedModel,
    commit: str,
    files: list[_RemoteFile],
    cache_dir: Path | None,
    on_progress: ProgressCallback | None,
) -> PullResult:
    assert model.repo_id is not None
    repo_dir = _cache_root(cache_dir) / repo_folder_name(repo_id=model.repo_id, repo_type="model")
    snapshot = repo_dir / "snapshots" / commit
    total, done, fetched = sum(f.size for f in files), 0, 0
    with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, read=120.0)) as client:
        for index, remote in enumerate(files):
            report = _file_reporter(model.repo_id, remote.path, index, len(files), done, total, on_progress)
            fetched += _ensure_file(client, model.repo_id, commit, remote, repo_dir, report)
            done += remote.size
            report(remote.size)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return PullResult(
        ref=model.ref,
        repo_id=model.repo_id,
        commit=commit,
        path=snapshot,
        num_files=len(files),
        num_bytes=total,
        downloaded_bytes=fetched,
    )


def _file_reporter(
    repo_id: str,
    name: str,
    index: int,
    count: int,
    done_before: int,
    total: int,
    on_progress: ProgressCallback | None,
) -> Callable[[int], None]:
    def report(file_bytes: int) -> None:
        if on_progress is not None:
            on_progress(
                PullProgress(
                    repo_id=repo_id,
                    file_name=name,
                    files_done=index,
                    files_total=count,
                    bytes_done=done_before + file_bytes,
                    bytes_total=total,
                )
            )

    return report


def _ensure_file(
    client: httpx.Client,
    repo_id: str,
    commit: str,
    remote: _RemoteFile,
    repo_dir: Path,
    report: Callable[[int], None],
) -> int:
    """Make `snapshots/<commit>/<path>` point at a verified blob, downloading what is missing.

    Returns the bytes downloaded. The layout is huggingface_hub's own: blobs are named by their etag
    (the sha256 for LFS files, the git blob id otherwise), snapshots hold relative symlinks to them.
    The blob appears only after verification, so no reader ever sees a partial or corrupt file.
    """
    etag = remote.sha256 or remote.blob_id
    blob = repo_dir / "blobs" / etag
    link = repo_dir / "snapshots" / commit / remote.path
    blob.parent.mkdir(parents=True, exist_ok=True)
    fetched = 0
    with FileLock(str(blob.parent / f"{etag}.lock")):  # another pull of the same file waits here
        if blob.exists():
            _verify_file(blob, remote)
        else:
            partial = blob.with_name(f"{etag}.incomplete")
            url = hf_hub_url(repo_id, remote.path, revision=commit, endpoint=_endpoint())
            fetched = _download_resumable(client, url, partial, remote.size, report)
            _verify_file(partial, remote)
            os.replace(partial, blob)
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink() or link.resolve() != blob.resolve():
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return fetched


def _download_resumable(
    client: httpx.Client, url: str, partial: Path, size: int, report: Callable[[int], None], attempts: int = 5
) -> int:
    """Append to `partial` from where it stops; a dropped connection retries from the new end.

    A failed pull leaves `partial` in place, so the next pull continues instead of starting over.
    """
    start = partial.stat().st_size if partial.exists() else 0
    if start > size:
        partial.unlink()
        start = 0
    for attempt in range(attempts):
        try:
            return _fetch_rest(client, url, partial, size, report) - start
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _fetch_rest(
    client: httpx.Client, url: str, partial: Path, size: int, report: Callable[[int], None]
) -> int:
    have = partial.stat().st_size if partial.exists() else 0
    if have == size:
        return have
    headers = build_hf_headers() | ({"Range": f"bytes={have}-"} if have else {})
    with client.stream("GET", url, headers=headers) as response:
        response.raise_for_status()
        if have and response.status_code != 206:  # the server ignored the range: start over
            have = 0
        report(have)
        with partial.open("ab" if have else "wb") as out:
            for chunk in response.iter_bytes():  # as they arrive: a cut keeps every byte received
                out.write(chunk)
                have += len(chunk)
                report(have)
    return have


def _verify_file(local: Path, remote: _RemoteFile) -> None:
    """Check a downloaded file against the hub's hash; a bad one is deleted so the next pull fetches it again."""
    actual_size = local.stat().st_size
    ok = actual_size == remote.size and (
        _sha256(local) == remote.sha256 if remote.sha256 else _git_blob_id(local) == remote.blob_id
    )
    if not ok:
        local.unlink(missing_ok=True)
        raise CheckpointError(
            f"{remote.path} failed verification (size {actual_size}, expected {remote.size} "
            "and the hub's hash); the bad copy was deleted, run the pull again"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _git_blob_id(path: Path) -> str:
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # noqa: S324 - git's object id, not security
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _cached_result(model: ResolvedModel, cache_dir: Path | None) -> PullResult:
    """Offline: the newest complete snapshot in the cache, or a clear error."""
    assert model.repo_id is not None
    local = find_local(model.repo_id, cache_dir)
    if local is None:
        raise ModelNotFound(
            f"{model.repo_id} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
            "unset it to download"
        )
    return PullResult(
        ref=model.ref,
        repo_id=model.repo_id,
        commit=local.commits[0],
        path=local.path,
        num_files=sum(1 for p in local.path.rglob("*") if p.is_file()),
        num_bytes=local.size_bytes,
        downloaded_bytes=0,
    )


class _translate_hub_errors:
    """Turn huggingface_hub and network exceptions into KapitsaErrors with a next step."""

    def __init__(self, repo_id: str) -> None:
        self.repo_id = repo_id

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: object) -> bool:
        if err is None or isinstance(err, KapitsaError):
            return False
        if isinstance(err, GatedRepoError):
            raise AuthError(
                f"{self.repo_id} is gated: accept its terms on the hub and log in "
                "(`hf auth login` or HF_TOKEN)"
            ) from err
        if isinstance(err, RepositoryNotFoundError | RevisionNotFoundError):
            raise ModelNotFound(f"{self.repo_id} was not found on {_endpoint()}") from err
        status = err.response.status_code if isinstance(err, httpx.HTTPStatusError) else None
        if status in (401, 403):
            raise AuthError(
                f"{self.repo_id} refused access ({status}): it may be gated or private; "
                "log in with `hf auth login` or set HF_TOKEN"
            ) from err
        if status == 404:
            raise ModelNotFound(f"a file of {self.repo_id} was not found on {_endpoint()}") from err
        if isinstance(err, (HfHubHTTPError, OSError, LocalEntryNotFoundError, *_network_errors())):
            raise KapitsaError(
                f"{_one_line_reason(err)} while downloading {self.repo_id} from {_endpoint()}. "
                "Run the pull again to resume; set HF_ENDPOINT for a mirror"
            ) from err
        return False


def _one_line_reason(err: BaseException) -> str:
    """The cause in a few words, first in the message so a one-line row still shows it (httpx's
    status errors add the URL and a link on further lines)."""
    if isinstance(err, httpx.HTTPStatusError):
        return f"HTTP {err.response.status_code} {err.response.reason_phrase}".strip()
    lines = str(err).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(err).__name__


def _aliases_by_repo(catalog: Catalog) -> dict[str, list[str]]:
    refs: dict[str, list[str]] = {}
    for entry in catalog:
        for quant in entry.quants:
            ref = entry.alias if quant.name == entry.default_quant else f"{entry.alias}:{quant.name}"
            refs.setdefault(quant.repo_id, []).append(ref)
    return refs


def list_local(*, catalog: Catalog, cache_dir: Path | None = None) -> list[LocalModel]:
    """Every model repo in the Hugging Face cache, with the catalog aliases that name it."""
    try:
        info = scan_cache_dir(_cache_root(cache_dir))
    except CacheNotFound:
        return []
    aliases = _aliases_by_repo(catalog)
    models = [
        _local_model(repo, aliases.get(repo.repo_id, []))
        for repo in info.repos
        if repo.repo_type == "model" and repo.revisions
    ]
    return sorted(models, key=lambda m: m.repo_id.lower())


def _local_model(repo: Any, refs: list[str]) -> LocalModel:
    newest = max(repo.revisions, key=lambda r: r.last_modified)
    commits = tuple(r.commit_hash for r in sorted(repo.revisions, key=lambda r: -r.last_modified))
    return LocalModel(
        repo_id=repo.repo_id,
        refs=tuple(refs),
        size_bytes=repo.size_on_disk,
        path=Path(newest.snapshot_path),
        commits=commits,
        last_modified=repo.last_modified,
    )


def find_local(repo_id: str, cache_dir: Path | None = None) -> LocalModel | None:
    try:
        info = scan_cache_dir(_cache_root(cache_dir))
    except CacheNotFound:
        return None
    for repo in info.repos:
        if repo.repo_id == repo_id and repo.repo_type == "model" and repo.revisions:
            return _local_model(repo, [])
    return None


def remove(ref: str, *, catalog: Catalog, cache_dir: Path | None = None) -> RemoveResult:
    """Delete every cached revision of the repo `ref` names."""
    model = resolve_model(ref, catalog)
    if model.kind != "hf" or model.repo_id is None:
        raise KapitsaError(f"{ref!r} is a local folder, not a downloaded model; kapitsa does not delete it")
    try:
        info = scan_cache_dir(_cache_root(cache_dir))
    except CacheNotFound:
        info = None
    repo = next(
        (r for r in (info.repos if info else ()) if r.repo_id == model.repo_id and r.repo_type == "model"),
        None,
    )
    if repo is None or info is None:
        raise ModelNotFound(f"{model.repo_id} is not in the Hugging Face cache")
    strategy = info.delete_revisions(*(r.commit_hash for r in repo.revisions))
    strategy.execute()
    return RemoveResult(repo_id=model.repo_id, freed_bytes=strategy.expected_freed_size)
