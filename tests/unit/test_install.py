"""install.sh, run for real in a temporary HOME: the isolated environment, the link, re-runs and --uninstall."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kapitsa import __version__

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "install.sh"
# Base interpreter of the test run (not its venv), so the installed environment shares nothing with it.
BASE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
PASSED_THROUGH = (
    "PIP_",
    "UV_",
    "SSL_",
    "REQUESTS_CA",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
)


def _uv() -> str:
    uv = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        if os.environ.get("CI"):
            pytest.fail("uv is missing: it is in the `test` dependency group")
        pytest.skip("uv is not installed")
    return uv


def _env(home: Path, *, tools: Path | None = None) -> dict[str, str]:
    """A clean environment: a fresh HOME, PATH with only system folders (plus `tools`), shared download caches."""
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_THROUGH)}
    real_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    env.setdefault("PIP_CACHE_DIR", str(real_cache / "pip"))
    env.setdefault("UV_CACHE_DIR", str(real_cache / "uv"))
    path = "/usr/local/bin:/usr/bin:/bin"
    env.update(
        HOME=str(home),
        PATH=f"{tools}:{path}" if tools else path,
        KAPITSA_PYTHON=str(BASE_PYTHON),
        LANG="C.UTF-8",
    )
    return env


def _tools_with(tmp_path: Path, **programs: str) -> Path:
    """A PATH folder holding the given programs (name -> a path to link, or a shell script body)."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for name, program in programs.items():
        target = tools / name
        if program.startswith("/"):
            target.symlink_to(program)
        else:
            target.write_text(f"#!/bin/sh\n{program}\n")
            target.chmod(0o755)
    return tools


def _install(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(INSTALL), *args], env=env, capture_output=True, text=True, timeout=300)


def _assert_installed(home: Path, env: dict[str, str]) -> None:
    link, venv = home / ".local/bin/kapitsa", home / ".kapitsa/venv"
    assert link.is_symlink() and Path(os.readlink(link)) == venv / "bin/kapitsa"
    version = subprocess.run([str(link), "--version"], env=env, capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"kapitsa {__version__}"
    # Run from HOME: from the checkout, `import kapitsa` would find the source tree first.
    where = subprocess.run(
        [str(venv / "bin/python"), "-c", "import kapitsa; print(kapitsa.__file__)"],
        env=env,
        cwd=home,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(venv)), "the install must be a copy, not the checkout"
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()


# Imports every module of the installed package: a runtime import that pyproject.toml does not declare fails here.
IMPORT_ALL = """
import importlib, pkgutil, kapitsa
for info in pkgutil.walk_packages(kapitsa.__path__, "kapitsa."):
    if info.name != "kapitsa.__main__":  # importing it runs the CLI
        try:
            importlib.import_module(info.name)
        except ImportError as err:
            print(f"{info.name}: {err!r}")
"""


def _unpackaged_files(venv: Path) -> list[str]:
    """Tracked files of kapitsa/ and metal/ (data included: catalog, styles, demo weights) missing from the install."""
    if not (ROOT / ".git").exists():
        return []
    tracked = subprocess.run(
        ["git", "ls-files", "kapitsa", "metal"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    (site,) = venv.glob("lib/python3*/site-packages")
    missing = []
    for name in tracked.stdout.splitlines():
        installed = (
            site / name.replace("metal/", "kapitsa/_metal/", 1) if name.startswith("metal/") else site / name
        )
        if (ROOT / name).is_file() and not installed.is_file():
            missing.append(name)
    return missing


def test_install_rerun_and_uninstall_with_uv(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = _env(home, tools=_tools_with(tmp_path, uv=_uv()))
    first = _install(env, "--from", str(ROOT))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "(uv)" in first.stdout and "is not on your PATH" in first.stdout
    _assert_installed(home, env)
    broken = subprocess.run(
        [str(home / ".kapitsa/venv/bin/python"), "-c", IMPORT_ALL],
        env=env,
        cwd=home,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert broken.returncode == 0 and broken.stdout == "", (
        "missing runtime dependencies:\n" + broken.stdout + broken.stderr
    )

    settings = home / ".kapitsa/settings.toml"
    settings.write_text("# user settings survive re-installs and --uninstall\n")
    again = _install(env)  # from a clone, no arguments installs that clone
    assert again.returncode == 0, again.stdout + again.stderr
    assert "reusing the environment" in again.stdout
    _assert_installed(home, env)

    gone = _install(env, "--uninstall")
    assert gone.returncode == 0, gone.stderr
    assert not (home / ".local/bin/kapitsa").exists() and not (home / ".kapitsa/venv").exists()
    assert settings.exists()
    assert "nothing to uninstall" in _install(env, "--uninstall").stdout


# About 30 s of CPU (pip resolves and unpacks every wheel): deselected by default; the uv test above covers CI.
# Run it with `bash scripts/test.sh -m slow tests/unit/test_install.py`.
@pytest.mark.slow
def test_install_without_uv_uses_venv_and_pip(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = _env(home)
    result = _install(env, "--from", str(ROOT))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "-m venv)" in result.stdout
    _assert_installed(home, env)


def test_never_replaces_a_command_it_did_not_make(tmp_path: Path) -> None:
    home = tmp_path / "home"
    foreign = home / ".local/bin/kapitsa"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("#!/bin/sh\necho another kapitsa\n")
    env = _env(home)
    result = _install(env, "--from", str(ROOT))
    assert result.returncode == 1 and "was not made by this installer" in result.stderr
    assert foreign.read_text() == "#!/bin/sh\necho another kapitsa\n"
    assert not (home / ".kapitsa/venv").exists()
    assert _install(env, "--uninstall").returncode == 0 and foreign.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unknown option: --bogus"),
        (["--from"], "--from needs a path"),
        (["--from", "/nonexistent/kapitsa"], "no such folder"),
        (["--from", "/"], "is not a kapitsa checkout"),
        (["--from", str(ROOT), "--package", "kapitsa"], "not both"),
    ],
)
def test_bad_arguments_fail_clearly(tmp_path: Path, args: list[str], message: str) -> None:
    result = _install(_env(tmp_path / "home"), *args)
    assert result.returncode == 1 and message in result.stderr
    assert not (tmp_path / "home/.kapitsa").exists()


def test_help() -> None:
    result = subprocess.run(["sh", str(INSTALL), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--uninstall" in result.stdout


@pytest.mark.parametrize(
    ("system", "machine", "translated", "macos", "message"),
    [
        ("Darwin", "x86_64", "0", "15.1", "needs a Mac with Apple silicon"),
        ("Darwin", "x86_64", "1", "15.1", "runs under Rosetta"),
        ("Darwin", "arm64", "0", "13.6", "needs macOS 14"),
        ("FreeBSD", "amd64", "0", "", "unsupported system FreeBSD"),
    ],
)
def test_platform_checks(
    tmp_path: Path, system: str, machine: str, translated: str, macos: str, message: str
) -> None:
    tools = _tools_with(
        tmp_path,
        uname=f'case "$1" in -s) echo {system};; -m) echo {machine};; *) echo {system};; esac',
        sysctl=f"echo {translated}",
        sw_vers=f"echo {macos}",
    )
    result = _install(_env(tmp_path / "home", tools=tools), "--from", str(ROOT))
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "home/.kapitsa").exists()


def test_readme_quick_start_is_what_install_and_ci_run() -> None:
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[
        readme.index("## Quick start") : readme.index("\n## ", readme.index("## Quick start") + 1)
    ]
    blocks = [b.split("\n```", 1)[0].strip() for b in quick_start.split("```sh\n")[1:]]
    assert blocks == ["sh install.sh && ~/.local/bin/kapitsa", "bash scripts/test.sh"]
    assert "exec bash scripts/test.sh" in (ROOT / ".ci/run").read_text()


FAKE_UV = """
echo "$*" >> "$(dirname "$0")/calls"
if [ "$1" = venv ]; then eval venv=\\${$#}; mkdir -p "$venv/bin"; ln -sf "$KAPITSA_PYTHON" "$venv/bin/python"; exit 0; fi
exit 3
"""


@pytest.mark.parametrize(
    ("args", "requirement"),
    [
        (["--package", "kapitsa==9.9"], "kapitsa==9.9"),
        (["--cuda", "--package", "kapitsa==9.9"], "kapitsa[cuda]==9.9"),
        (["--from", f"{ROOT}/kapitsa/.."], str(ROOT)),
        (["--cuda", "--from", str(ROOT)], f"kapitsa[cuda] @ file://{ROOT}"),
    ],
)
def test_what_gets_installed(tmp_path: Path, args: list[str], requirement: str) -> None:
    tools = _tools_with(tmp_path, uv=FAKE_UV)  # records the calls; the install itself then fails
    result = _install(_env(tmp_path / "home", tools=tools), *args)
    assert result.returncode != 0
    install_call = (tools / "calls").read_text().splitlines()[-1]
    assert install_call.startswith("pip install ") and install_call.endswith(f" {requirement}")


def test_uninstall_says_what_it_leaves_and_purge_removes_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = _env(home)
    state = home / (
        "Library/Application Support/kapitsa" if sys.platform == "darwin" else ".local/state/kapitsa"
    )
    (state / "prefix-cache").mkdir(parents=True)
    (state / "prefix-cache/block").write_bytes(b"x" * 200_000)
    kept = _install(env, "--uninstall")
    assert kept.returncode == 0, kept.stderr
    assert f"kept {state} (" in kept.stdout and "--purge" in kept.stdout
    assert "K" in kept.stdout.split(f"kept {state} (")[1].split(":")[0]  # its size, as du -h gives it
    assert state.exists()
    purged = _install(env, "--purge")
    assert purged.returncode == 0, purged.stderr
    assert f"removed {state}" in purged.stdout and not state.exists()
