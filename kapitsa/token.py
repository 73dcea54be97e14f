"""The API token: kept in the OS keyring; where no keyring backend exists (CI, headless Linux), in a
0600 file in kapitsa's state folder, with a warning. Never a crash.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kapitsa.private_files import atomic_write

SERVICE = "kapitsa"
ACCOUNT = "api-token"
FILE_NAME = "api-token"


@dataclass(slots=True, frozen=True)
class TokenState:
    token: str | None
    storage: Literal["keyring", "file", "none"]
    location: str  # the keyring backend's name or the file's path
    warning: str | None = None


def _keyring_backend() -> tuple[object | None, str | None]:
    """The usable keyring backend, or None and why not."""
    try:
        import keyring
        from keyring.backends import fail

        backend = keyring.get_keyring()
    except Exception as err:  # noqa: BLE001 - any backend import/discovery failure means "no keyring"
        return None, f"keyring unavailable ({err})"
    if isinstance(backend, fail.Keyring) or float(getattr(backend, "priority", 1)) <= 0:
        return None, "no OS keyring backend is available"
    return backend, None


def _file_path(state_dir: Path) -> Path:
    return state_dir / FILE_NAME


def _fallback_warning(reason: str, path: Path) -> str:
    return f"{reason}; the token is kept in {path} (mode 0600) instead"


def get_token(state_dir: Path) -> TokenState:
    backend, reason = _keyring_backend()
    if backend is not None:
        try:
            value = backend.get_password(SERVICE, ACCOUNT)  # type: ignore[attr-defined]
            if value:
                return TokenState(value, "keyring", _backend_name(backend))
        except Exception as err:  # noqa: BLE001 - a locked or broken keyring falls back to the file
            reason = f"keyring read failed ({err})"
    path = _file_path(state_dir)
    if path.is_file():
        warning = _fallback_warning(reason, path) if reason else None
        return TokenState(path.read_text().strip() or None, "file", str(path), warning)
    return TokenState(None, "none", _backend_name(backend) if backend is not None else str(path))


def rotate_token(state_dir: Path) -> TokenState:
    """A new random token replaces the old one (servers started earlier keep the old one until restarted)."""
    token = "kap-" + secrets.token_urlsafe(32)
    backend, reason = _keyring_backend()
    if backend is not None:
        try:
            backend.set_password(SERVICE, ACCOUNT, token)  # type: ignore[attr-defined]
            _file_path(state_dir).unlink(missing_ok=True)
            return TokenState(token, "keyring", _backend_name(backend))
        except Exception as err:  # noqa: BLE001
            reason = f"keyring write failed ({err})"
    path = _write_private_file(_file_path(state_dir), token)
    return TokenState(token, "file", str(path), _fallback_warning(reason or "no keyring", path))


def clear_token(state_dir: Path) -> TokenState:
    backend, _reason = _keyring_backend()
    if backend is not None:
        with contextlib.suppress(Exception):  # nothing stored is the state we want
            backend.delete_password(SERVICE, ACCOUNT)  # type: ignore[attr-defined]
    path = _file_path(state_dir)
    path.unlink(missing_ok=True)
    return TokenState(None, "none", _backend_name(backend) if backend is not None else str(path))


def _write_private_file(path: Path, token: str) -> Path:
    return atomic_write(path, (token + "\n").encode())


def _backend_name(backend: object) -> str:
    return f"OS keyring ({type(backend).__module__}.{type(backend).__name__})"
