"""The release artifacts: `make dist`'s sdist and wheel (tools/build_dist.py), built once per session.

The wheel must carry what kapitsa reads at run time besides its modules (the demo model, the CUDA and Metal
kernel sources), run from a fresh environment, and the formula must pin the sdist this tree builds to.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


build_dist = _load_tool("build_dist")
gen_formula = _load_tool("gen_formula")


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_dist.build(tmp_path_factory.mktemp("dist"))


def _package_files() -> set[str]:
    """The wheel paths of every file in the source package, and of metal/ (force-included as kapitsa/_metal)."""
    files = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "kapitsa").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    return files | {f"kapitsa/_metal/{p.name}" for p in (ROOT / "metal").iterdir() if p.is_file()}


def test_wheel_carries_the_demo_model_and_the_kernel_sources(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = set(wheel.namelist())
        entry_points = wheel.read(f"kapitsa-{build_dist.version()}.dist-info/entry_points.txt").decode()
    for required in (
        "kapitsa/demo/model.safetensors",
        "kapitsa/demo/config.json",
        "kapitsa/demo/tokenizer.json",
        "kapitsa/engine/kernels/cuda_src/matvec.cuh",
        "kapitsa/engine/kernels/cuda_src/gdn_step.cu",
        "kapitsa/_metal/gdn_step.metal",
    ):
        assert required in names
    assert not _package_files() - names, "files the package has but the wheel lacks"
    assert not {n for n in names if n.startswith(("tests/", "lab/", "tools/"))}
    assert "kapitsa = kapitsa._entry:main" in entry_points


def test_sdist_holds_the_build_inputs_and_rebuilds_byte_for_byte(
    dist: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tarfile.open(dist["sdist"]) as sdist:
        top = {Path(name).parts[1] for name in sdist.getnames() if len(Path(name).parts) > 1}
    assert top == {".gitignore", "PKG-INFO", "README.md", "pyproject.toml", "kapitsa", "metal"}
    # Two builds back to back (not against the session's, which a concurrent edit of the tree may predate);
    # an inherited SOURCE_DATE_EPOCH must not change the bytes.
    first = build_dist.build(tmp_path / "a", wheel=False)["sdist"]
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    second = build_dist.build(tmp_path / "b", wheel=False)["sdist"]
    assert first.read_bytes() == second.read_bytes()


def test_formula_generated_from_the_built_sdist_pins_its_checksum(dist: dict[str, Path]) -> None:
    """What `make formula` writes at release: this version's PyPI sdist URL and the built sdist's sha256;
    the committed formula differs from it at most in that checksum (pinned at the last release)."""
    version = build_dist.version()
    built = hashlib.sha256(dist["sdist"].read_bytes()).hexdigest()
    generated = gen_formula.render(gen_formula.load_lock(), version=version, sha256=built)
    match = re.search(r'^  url "([^"]+)"\n  sha256 "([0-9a-f]{64})"$', generated, re.M)
    assert match and match.group(2) == built
    assert (
        match.group(1) == f"https://files.pythonhosted.org/packages/source/k/kapitsa/kapitsa-{version}.tar.gz"
    )
    committed = (ROOT / "Formula" / "kapitsa.rb").read_text()
    pinned = gen_formula.pinned_sha256(committed)
    assert committed == generated.replace(built, pinned), "run `make formula` and commit Formula/kapitsa.rb"


def _fresh_venv(where: Path) -> Path:
    """A new venv without kapitsa whose dependencies come from this environment (a .pth of its site dirs,
    appended after the venv's own, so the installed wheel's kapitsa is the one imported)."""
    venv.create(where, with_pip=False)
    python = where / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "_kapitsa_test_deps.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


def test_wheel_installs_into_a_fresh_venv_and_runs_the_demo(dist: dict[str, Path], tmp_path: Path) -> None:
    python = _fresh_venv(tmp_path / "venv")
    install = [
        sys.executable,
        "-m",
        "uv",
        "pip",
        "install",
        "--offline",
        "--no-deps",
        "--python",
        str(python),
    ]
    subprocess.run([*install, str(dist["wheel"])], capture_output=True, text=True, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KAPITSA_", "XDG_"))}
    env |= {"HOME": str(tmp_path / "home"), "PATH": f"{python.parent}{os.pathsep}{env.get('PATH', '')}"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)

    where = run(str(python), "-c", "import kapitsa; print(kapitsa.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(tmp_path / "venv"), where.stdout
    kapitsa = str(python.parent / "kapitsa")
    version = run(kapitsa, "--version")
    assert version.returncode == 0 and version.stdout == f"kapitsa {build_dist.version()}\n", version.stderr
    out = run(kapitsa, "run", "--model", "demo", "--max-tokens", "4", "--json", "hi")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["generation_tokens"] == 4 and len(result["token_ids"]) == 4 and result["text"]
