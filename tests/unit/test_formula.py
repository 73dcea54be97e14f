"""Formula/kapitsa.rb is generated from uv.lock by tools/gen_formula.py; these tests keep the three in step."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
FORMULA = ROOT / "Formula" / "kapitsa.rb"
STUB = Path(__file__).with_name("homebrew_stub.rb")


def _load_gen_formula():
    spec = importlib.util.spec_from_file_location("gen_formula", ROOT / "tools" / "gen_formula.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_formula"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


gen = _load_gen_formula()


def _ruby() -> str:
    ruby = shutil.which("ruby")
    if ruby is None:
        if os.environ.get("CI"):
            pytest.fail("ruby is missing: .ci/run installs it (apt-get install ruby)")
        pytest.skip("ruby is not installed (apt-get install ruby / brew install ruby)")
    return ruby


def test_formula_and_lock_are_in_sync_with_pyproject() -> None:
    out = subprocess.run(
        [sys.executable, "tools/gen_formula.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    # On failure the message says how to regenerate: `uv lock && python tools/gen_formula.py`.
    assert out.returncode == 0, out.stderr


def test_formula_parses_as_ruby() -> None:
    out = subprocess.run([_ruby(), "-c", str(FORMULA)], capture_output=True, text=True)
    assert out.returncode == 0 and "Syntax OK" in out.stdout, out.stderr


def test_formula_evaluates_with_resources_from_the_lock() -> None:
    out = subprocess.run([_ruby(), str(STUB), str(FORMULA)], capture_output=True, text=True, check=True)
    declared = json.loads(out.stdout)
    lock = gen.load_lock()
    expected = [gen.to_resource(p) for p in gen.runtime_packages(lock) if p["name"] not in gen.FROM_FORMULAE]
    assert declared["class"] == "Kapitsa"
    assert declared["resources"] == [{"name": r.name, "url": r.url, "sha256": r.sha256} for r in expected]
    assert all(len(r["sha256"]) == 64 for r in declared["resources"])
    assert {"macos", "arch=>arm64", "mlx", "python@3.14"} <= set(declared["depends_on"])
    assert declared["methods"] == ["install"] and declared["test"] is True


def test_formula_shape() -> None:
    text = FORMULA.read_text()
    assert "include Language::Python::Virtualenv" in text
    assert "virtualenv_install_with_resources" in text
    assert 'shell_output("#{bin}/kapitsa --version")' in text
    assert 'shell_output("#{bin}/kapitsa doctor --json")' in text
    names = [line.split('"')[1] for line in text.splitlines() if line.startswith("  resource ")]
    # Linux-only builds, Homebrew-provided packages and test tools stay out of the resources.
    assert names == sorted(names) and names
    assert not {"mlx", "mlx-cpu", "mlx-metal", "numpy", "pytest", "ruff", "uv"} & set(names)
    assert {"textual", "fastapi", "typer", "tokenizers", "huggingface-hub"} <= set(names)


def test_resources_built_from_source_bring_their_build_tools() -> None:
    """Homebrew builds each resource from its sdist: Rust for the Rust-built ones, autotools for
    uvloop's vendored libuv; neither without such a resource."""
    res = gen.Resource
    with_uvloop = gen._depends_on([], [res("uvloop", "u", "h"), res("tokenizers", "u", "h")])
    assert with_uvloop[:4] == [
        f'  depends_on "{tool}" => :build' for tool in ("autoconf", "automake", "libtool", "rust")
    ]
    assert not [line for line in gen._depends_on([], [res("rich", "u", "h")]) if ":build" in line]


def _package(name: str, version: str = "1.0", **fields) -> dict:
    sdist = {"url": f"https://files.example/{name}-{version}.tar.gz", "hash": "sha256:" + "a" * 64}
    return {"name": name, "version": version, "source": {"registry": "x"}, "sdist": sdist, **fields}


TOY_LOCK = {
    "package": [
        {
            "name": "kapitsa",
            "source": {"editable": "."},
            "dependencies": [
                {"name": "mlx", "marker": "sys_platform == 'darwin'"},
                {"name": "mlx", "extra": ["cpu"], "marker": "sys_platform == 'linux'"},
                {"name": "web", "extra": ["fast"]},
                {"name": "np", "version": "1.0", "marker": "python_full_version < '3.12'"},
                {"name": "np", "version": "2.0", "marker": "python_full_version >= '3.12'"},
            ],
        },
        _package("mlx", dependencies=[{"name": "mlx-metal"}]),
        _package("mlx-metal"),
        _package(
            "web",
            dependencies=[{"name": "colorama", "marker": "sys_platform == 'win32'"}],
            **{"optional-dependencies": {"fast": [{"name": "speedups"}]}},
        ),
        _package("speedups"),
        _package("colorama"),
        _package("np", "1.0"),
        _package("np", "2.0"),
    ]
}


def test_closure_follows_markers_extras_and_forks() -> None:
    names = [(p["name"], p["version"]) for p in gen.runtime_packages(TOY_LOCK)]
    # mlx comes from Homebrew, so its own dependencies are not walked; win32-only colorama is dropped.
    assert names == [("mlx", "1.0"), ("np", "2.0"), ("speedups", "1.0"), ("web", "1.0")]
    py311 = {**gen.TARGET_ENV, "python_full_version": "3.11.9", "python_version": "3.11"}
    assert ("np", "1.0") in [(p["name"], p["version"]) for p in gen.runtime_packages(TOY_LOCK, py311)]


def test_resource_prefers_sdist_then_pure_wheel_else_explains() -> None:
    wheel = {"url": "https://files.example/w-1.0-py3-none-any.whl", "hash": "sha256:" + "b" * 64}
    binary = {
        "url": "https://files.example/b-1.0-cp314-cp314-macosx_14_0_arm64.whl",
        "hash": "sha256:" + "c" * 64,
    }
    assert gen.to_resource(_package("s")).url.endswith(".tar.gz")
    assert gen.to_resource({"name": "w", "wheels": [binary, wheel]}).sha256 == "b" * 64
    with pytest.raises(gen.FormulaError, match="FROM_FORMULAE"):
        gen.to_resource({"name": "b", "wheels": [binary]})


def _pyproject_edits() -> list[tuple[str, str, str]]:
    """(old, new, name) edits to pyproject.toml that the lock check must notice, derived from the file itself."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = next(d for d in project["dependencies"] if ";" not in d and any(op in d for op in "=<>"))
    marked = next(d for d in project["dependencies"] if ";" in d)
    return [
        ("dependencies = [\n", 'dependencies = [\n  "brand-new-dep>=1",\n', "brand-new-dep"),
        (f'"{pinned}"', f'"{pinned},<999"', canonicalize_name(Requirement(pinned).name)),
        (f'"{marked}"', f'"{marked.split(";")[0]}"', canonicalize_name(Requirement(marked).name)),
        ("test = [\n", 'test = [\n  "hypothesis-not-declared",\n', "hypothesis-not-declared"),
    ]


@pytest.mark.parametrize(("old", "new", "what"), _pyproject_edits())
def test_lock_check_notices_pyproject_edits(tmp_path: Path, old: str, new: str, what: str) -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert old in text
    (tmp_path / "pyproject.toml").write_text(text.replace(old, new, 1))
    with pytest.raises(gen.FormulaError, match=rf"{re.escape(what)}.*uv lock && python tools/gen_formula.py"):
        gen.check_lock_matches(tmp_path / "pyproject.toml", ROOT / "uv.lock")


def test_sdist_checksum_pinning(tmp_path: Path) -> None:
    version = gen._version()
    sdist = tmp_path / f"kapitsa-{version}.tar.gz"
    sdist.write_bytes(b"release bytes")
    assert gen.sdist_sha256(version, sdist) == hashlib.sha256(b"release bytes").hexdigest()
    with pytest.raises(gen.FormulaError, match="is not kapitsa"):
        gen.sdist_sha256(version, tmp_path / "kapitsa-0.0.0.tar.gz")
    with pytest.raises(gen.FormulaError, match="make dist"):
        gen.sdist_sha256("9.9.9", tmp_path / "kapitsa-9.9.9.tar.gz")
    # Without --sdist the checksum is that of the sdist built from this tree (tests/unit/test_dist.py
    # checks the committed formula pins it).
    assert re.fullmatch(r"[0-9a-f]{64}", gen.sdist_sha256(version, None))


def test_doctor_json_has_what_the_formula_test_reads() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kapitsa", "doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert isinstance(json.loads(out.stdout)["hardware"]["is_apple_silicon"], bool)
    assert 'report["hardware"]["is_apple_silicon"]' in FORMULA.read_text()
