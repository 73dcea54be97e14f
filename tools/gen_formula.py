"""Generate Formula/kapitsa.rb (Homebrew) from uv.lock.

The formula's resources are the lock's runtime packages for the formula's one target: macOS on Apple
silicon with Homebrew's Python. Packages Homebrew already ships as formulae (MLX, NumPy, certifi) become
`depends_on` lines instead, as in homebrew-core's mlx-lm formula.

The formula's `url` is the release sdist on PyPI (`sdist_url`) and its `sha256` is that of the sdist built
from this tree by tools/build_dist.py (reproducible: the same tree gives the same bytes), so the formula
changes with every change to what the sdist holds (kapitsa/, metal/, README.md, pyproject.toml).

    python tools/gen_formula.py            build the sdist, rewrite Formula/kapitsa.rb (after `uv lock`)
    python tools/gen_formula.py --check    exit 1 if the formula or the lock is out of date with the tree
    python tools/gen_formula.py --sdist dist/kapitsa-X.Y.Z.tar.gz
                                           pin that sdist instead of building one (`make dist` made it)
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import re
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
FORMULA = ROOT / "Formula" / "kapitsa.rb"
REGENERATE = "uv lock && python tools/gen_formula.py"

HOMEBREW_PYTHON = "python@3.14"
# The marker environment of the formula's target: Homebrew's python@3.14 on macOS arm64.
TARGET_ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.14.0",
    "os_name": "posix",
    "platform_machine": "arm64",
    "platform_python_implementation": "CPython",
    "platform_system": "Darwin",
    "python_full_version": "3.14.0",
    "python_version": "3.14",
    "sys_platform": "darwin",
    "extra": "",
}
# Native packages taken from Homebrew formulae rather than built as resources (mlx-metal ships inside mlx).
FROM_FORMULAE = {"certifi": "certifi", "mlx": "mlx", "mlx-metal": "mlx", "numpy": "numpy"}
# Resources whose sdists compile Rust code: their presence adds `depends_on "rust" => :build`.
RUST_BUILT = {
    "cryptography",
    "hf-xet",
    "jiter",
    "orjson",
    "pydantic-core",
    "rpds-py",
    "safetensors",
    "tokenizers",
    "watchfiles",
}
# Resources whose sdists build a vendored C library with autotools (uvloop's libuv: autogen.sh, configure).
AUTOTOOLS_BUILT = {"uvloop"}
AUTOTOOLS = ("autoconf", "automake", "libtool")
PURE_WHEEL = re.compile(r"-py3(\.py\d)?-none-any\.whl$|-py2\.py3-none-any\.whl$")


class FormulaError(Exception):
    """The lock cannot be turned into a formula (or the formula is stale); the message says what to do."""


@dataclass(frozen=True, slots=True)
class Resource:
    name: str
    url: str
    sha256: str


def load_lock(path: Path = ROOT / "uv.lock") -> dict:
    if not path.exists():
        raise FormulaError(f"{path} is missing: run `{REGENERATE}`")
    return tomllib.loads(path.read_text())


def _root_package(lock: dict) -> dict:
    for package in lock["package"]:
        if (
            package.get("source", {}).get("editable") == "."
            or package.get("source", {}).get("virtual") == "."
        ):
            return package
    raise FormulaError("uv.lock has no entry for the project itself")


def _applies(marker: str | None, env: dict[str, str]) -> bool:
    return marker is None or Marker(marker).evaluate(env)


def _pick(lock: dict, dep: dict, env: dict[str, str]) -> dict:
    """The locked package a dependency entry refers to (uv forks some packages by Python version)."""
    candidates = [p for p in lock["package"] if p["name"] == dep["name"]]
    if "version" in dep:
        candidates = [p for p in candidates if p.get("version") == dep["version"]]
    if len(candidates) > 1:
        candidates = [p for p in candidates if any(_applies(m, env) for m in p.get("resolution-markers", []))]
    if len(candidates) != 1:
        raise FormulaError(f"uv.lock: cannot tell which {dep['name']} applies to macOS arm64")
    return candidates[0]


def runtime_packages(lock: dict, env: dict[str, str] = TARGET_ENV) -> list[dict]:
    """The project's runtime dependency closure under `env` (no extras, no dependency groups)."""
    found: dict[str, dict] = {}
    seen: set[tuple[str, str, tuple[str, ...]]] = set()
    todo = [d for d in _root_package(lock).get("dependencies", []) if _applies(d.get("marker"), env)]
    while todo:
        dep = todo.pop()
        package = _pick(lock, dep, env)
        key = (package["name"], package.get("version", ""), tuple(dep.get("extra", [])))
        if key in seen:
            continue
        seen.add(key)
        found[package["name"]] = package
        if package["name"] in FROM_FORMULAE:  # a Homebrew formula brings its own dependencies
            continue
        edges = list(package.get("dependencies", []))
        for extra in dep.get("extra", []):
            edges += package.get("optional-dependencies", {}).get(extra, [])
        todo += [d for d in edges if _applies(d.get("marker"), env)]
    return sorted(found.values(), key=lambda p: p["name"])


def to_resource(package: dict) -> Resource:
    """Homebrew builds resources from sdists; a pure-Python wheel is accepted where there is no sdist."""
    if "sdist" in package:
        artifact = package["sdist"]
    else:
        wheels = [w for w in package.get("wheels", []) if PURE_WHEEL.search(w["url"])]
        if not wheels:
            raise FormulaError(
                f"{package['name']} has no sdist or pure-Python wheel in uv.lock: "
                "add the Homebrew formula that provides it to FROM_FORMULAE in tools/gen_formula.py"
            )
        artifact = wheels[0]
    algorithm, _, digest = artifact["hash"].partition(":")
    if algorithm != "sha256":
        raise FormulaError(f"{package['name']}: uv.lock hash is {algorithm}, Homebrew needs sha256")
    return Resource(name=package["name"], url=artifact["url"], sha256=digest)


# Environments on which pyproject's and the lock's requirement markers must agree.
_PROBE_ENVS = [
    {
        **TARGET_ENV,
        "sys_platform": system,
        "platform_system": name,
        "platform_machine": machine,
        "python_version": py,
        "python_full_version": f"{py}.0",
        "extra": extra,
    }
    for system, name, machine in [
        ("darwin", "Darwin", "arm64"),
        ("darwin", "Darwin", "x86_64"),
        ("linux", "Linux", "x86_64"),
        ("linux", "Linux", "aarch64"),
        ("win32", "Windows", "AMD64"),
    ]
    for py in ("3.11", "3.12", "3.14")
    for extra in ("", "cuda")
]


def _requirement_key(name: str, extras, specifier: str, marker: str | None) -> tuple:
    """A comparable form: markers are compared by their truth on a grid, since uv rewrites them."""
    truth = tuple(_applies(marker, env) for env in _PROBE_ENVS)
    specs = tuple(sorted(str(s) for s in SpecifierSet(specifier or "")))
    return canonicalize_name(name), tuple(sorted(extras or ())), specs, truth


def _declared(pyproject: dict) -> dict[str, set[tuple]]:
    """pyproject's requirements: runtime (with extras' markers folded in, as uv records them) and groups."""
    project = pyproject["project"]
    runtime = [Requirement(r) for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        for raw in reqs:
            req = Requirement(raw)
            marker = f"({req.marker}) and extra == '{extra}'" if req.marker else f"extra == '{extra}'"
            req.marker = Marker(marker)
            runtime.append(req)
    declared = {
        "": {
            _requirement_key(r.name, r.extras, str(r.specifier), str(r.marker) if r.marker else None)
            for r in runtime
        }
    }
    for group, reqs in pyproject.get("dependency-groups", {}).items():
        parsed = [Requirement(r) for r in reqs if isinstance(r, str)]
        declared[group] = {
            _requirement_key(r.name, r.extras, str(r.specifier), str(r.marker) if r.marker else None)
            for r in parsed
        }
    return declared


def _locked(lock: dict) -> dict[str, set[tuple]]:
    metadata = _root_package(lock).get("metadata", {})

    def keys(entries: list[dict]) -> set[tuple]:
        return {
            _requirement_key(e["name"], e.get("extras"), e.get("specifier", ""), e.get("marker"))
            for e in entries
        }

    locked = {"": keys(metadata.get("requires-dist", []))}
    for group, entries in metadata.get("requires-dev", {}).items():
        locked[group] = keys(entries)
    return locked


def check_lock_matches(
    pyproject_path: Path = ROOT / "pyproject.toml", lock_path: Path = ROOT / "uv.lock"
) -> None:
    """Raise FormulaError when uv.lock was not made from pyproject.toml's current requirements."""
    declared = _declared(tomllib.loads(pyproject_path.read_text()))
    locked = _locked(load_lock(lock_path))
    for group in sorted(set(declared) | set(locked)):
        missing = {k[0] for k in declared.get(group, set()) - locked.get(group, set())}
        stale = {k[0] for k in locked.get(group, set()) - declared.get(group, set())}
        if missing or stale:
            where = f"dependency group {group!r}" if group else "runtime dependencies"
            raise FormulaError(
                f"uv.lock is out of date with pyproject.toml ({where}: changed {sorted(missing | stale)}); "
                f"regenerate with `{REGENERATE}`"
            )


# Libraries some resources link against when Homebrew builds them.
LIBRARY_FORMULAE = {"pyyaml": "libyaml"}
DESCRIPTION = "Local LLM engine and coding-agent launcher for Apple silicon"
HEADER = (
    f"# Generated by tools/gen_formula.py from uv.lock and the sdist: do not edit by hand; run `{REGENERATE}`.\n"
    "# url: the release sdist on PyPI; sha256: that of `make dist`'s reproducible sdist of this tree.\n"
)


def _build_dist():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_dist
    finally:
        sys.path.pop(0)
    return build_dist


def _version() -> str:
    build_dist = _build_dist()
    try:
        return build_dist.version()
    except build_dist.BuildError as err:
        raise FormulaError(str(err)) from err


def sdist_url(version: str) -> str:
    """Where the release sdist lives: PyPI's stable source URL, valid once `make dist`'s sdist is uploaded."""
    return f"https://files.pythonhosted.org/packages/source/k/kapitsa/kapitsa-{version}.tar.gz"


def sdist_sha256(version: str, sdist: Path | None) -> str:
    """The checksum of `sdist` (checked to be this version's), or of the sdist built from this tree."""
    if sdist is None:
        build_dist = _build_dist()
        with tempfile.TemporaryDirectory(prefix="kapitsa-sdist-") as tmp:
            try:
                built = build_dist.build(Path(tmp), wheel=False)["sdist"]
            except build_dist.BuildError as err:
                raise FormulaError(str(err)) from err
            return hashlib.sha256(built.read_bytes()).hexdigest()
    if sdist.name != f"kapitsa-{version}.tar.gz":
        raise FormulaError(
            f"--sdist {sdist.name} is not kapitsa-{version}.tar.gz (the version in kapitsa/__init__.py)"
        )
    if not sdist.is_file():
        raise FormulaError(f"--sdist {sdist} does not exist: build it with `make dist`")
    return hashlib.sha256(sdist.read_bytes()).hexdigest()


def _depends_on(packages: list[dict], resources: list[Resource]) -> list[str]:
    """Build dependencies first, then the rest sorted by name, as homebrew-core orders them."""
    names = {p["name"] for p in packages}
    built = {r.name for r in resources}
    build = [f'"{tool}" => :build' for tool in AUTOTOOLS] if AUTOTOOLS_BUILT & built else []
    build += ['"rust" => :build'] if RUST_BUILT & built else []
    formulae = {FROM_FORMULAE[n] for n in names if n in FROM_FORMULAE} | {
        LIBRARY_FORMULAE[n] for n in names if n in LIBRARY_FORMULAE
    }
    runtime = [f'"{f}"' for f in formulae | {HOMEBREW_PYTHON}] + [":macos", "macos: :sonoma"]
    runtime.sort(key=lambda line: line.strip('":'))
    return [f"  depends_on {line}" for line in [*build, "arch: :arm64", *runtime]]


def _resource_block(resource: Resource) -> str:
    return (
        f'  resource "{resource.name}" do\n    url "{resource.url}"\n    sha256 "{resource.sha256}"\n  end\n'
    )


def render(lock: dict, *, version: str, sha256: str) -> str:
    packages = runtime_packages(lock)
    resources = [to_resource(p) for p in packages if p["name"] not in FROM_FORMULAE]
    excluded = " ".join(sorted({p["name"] for p in packages if p["name"] in FROM_FORMULAE}))
    head = [
        HEADER + "class Kapitsa < Formula",
        "  include Language::Python::Virtualenv",
        "",
        f'  desc "{DESCRIPTION}"',
        '  homepage "https://pypi.org/project/kapitsa/"',
        f'  url "{sdist_url(version)}"',
        f'  sha256 "{sha256}"',
        '  license "Apache-2.0"',
        "",
        *_depends_on(packages, resources),
        "",
        f"  pypi_packages exclude_packages: %w[{excluded}]",
        "",
    ]
    tail = [
        "  def install",
        "    virtualenv_install_with_resources",
        "  end",
        "",
        "  test do",
        '    assert_match "kapitsa #{version}", shell_output("#{bin}/kapitsa --version")',
        '    report = JSON.parse(shell_output("#{bin}/kapitsa doctor --json"))',
        '    assert report["hardware"]["is_apple_silicon"]',
        "  end",
        "end",
    ]
    return (
        "\n".join(head)
        + "\n"
        + "\n".join(_resource_block(r) for r in resources)
        + "\n"
        + "\n".join(tail)
        + "\n"
    )


def pinned_sha256(formula: str) -> str | None:
    """The top-level (the package's own) sha256 of a formula's text, or None."""
    match = re.search(r'^  sha256 "([0-9a-f]{64})"$', formula, re.M)
    return match.group(1) if match else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="fail if Formula/kapitsa.rb or uv.lock is out of date"
    )
    parser.add_argument(
        "--sdist", type=Path, help="pin this sdist's checksum instead of building one from the tree"
    )
    args = parser.parse_args(argv)
    try:
        check_lock_matches()
        version = _version()
        current = FORMULA.read_text() if FORMULA.exists() else ""
        # --check holds everything but the sdist's checksum to the tree: that one is pinned at
        # release (`make formula`), so everyday commits need not re-pin it.
        pinned = pinned_sha256(current) if args.check and args.sdist is None else None
        sha256 = pinned or sdist_sha256(version, args.sdist)
        text = render(load_lock(), version=version, sha256=sha256)
    except FormulaError as err:
        print(f"gen_formula: {err}", file=sys.stderr)
        return 1
    if args.check:
        if text == current:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(True), text.splitlines(True), "Formula/kapitsa.rb", "generated"
        )
        print(
            "".join(diff)
            + f"\nFormula/kapitsa.rb is out of date with uv.lock or pyproject.toml: run `{REGENERATE}`",
            file=sys.stderr,
        )
        return 1
    FORMULA.write_text(text)
    print(f"wrote {FORMULA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
