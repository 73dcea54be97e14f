"""Build kapitsa's release artifacts, the sdist and the wheel, reproducibly (`make dist`).

The same tree gives the same bytes: hatchling is pinned in pyproject's [build-system], the sdist holds only
what a build needs (pyproject's [tool.hatch.build.targets.sdist]), and every archive entry carries the fixed
SOURCE_DATE_EPOCH below whatever the environment says. Formula/kapitsa.rb pins the sdist's sha256, so the
file uploaded at release is the file this script builds.

    python tools/build_dist.py [OUT_DIR]          sdist and wheel into OUT_DIR (default dist/)
    python tools/build_dist.py --sdist [OUT_DIR]  the sdist only
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# hatchling's own default (2020-02-02); set explicitly so an inherited SOURCE_DATE_EPOCH cannot change the bytes.
SOURCE_DATE_EPOCH = "1580601600"


class BuildError(Exception):
    """The build failed; the message has uv's output."""


def version() -> str:
    match = re.search(r'^__version__ = "([^"]+)"', (ROOT / "kapitsa" / "__init__.py").read_text(), re.M)
    if not match:
        raise BuildError("kapitsa/__init__.py has no __version__")
    return match.group(1)


def build(out_dir: Path, *, wheel: bool = True) -> dict[str, Path]:
    """Build into `out_dir`; returns {"sdist": path, "wheel": path} (no "wheel" when wheel=False).

    The wheel is built from the sdist, as pip and Homebrew do, so a file the sdist misses is missing from
    the wheel too."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "uv", "build", "--no-progress", "--out-dir", str(out_dir), str(ROOT)]
    if not wheel:
        cmd.insert(4, "--sdist")
    env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise BuildError(f"`{' '.join(cmd[2:])}` failed:\n{out.stderr.strip()}")
    v = version()
    built = {"sdist": out_dir / f"kapitsa-{v}.tar.gz"}
    if wheel:
        built["wheel"] = out_dir / f"kapitsa-{v}-py3-none-any.whl"
    missing = [str(p) for p in built.values() if not p.is_file()]
    if missing:
        raise BuildError(f"uv build succeeded but did not write {', '.join(missing)}")
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=ROOT / "dist")
    parser.add_argument("--sdist", action="store_true", help="build the sdist only")
    args = parser.parse_args(argv)
    try:
        built = build(args.out_dir, wheel=not args.sdist)
    except BuildError as err:
        print(f"build_dist: {err}", file=sys.stderr)
        return 1
    for path in built.values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
