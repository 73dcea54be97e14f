"""The `kapitsa` console script. `kapitsa --version` is answered here, before the CLI framework
(Typer, Click) is imported: that import is most of the command's start-up time."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        from kapitsa import __version__

        print(f"kapitsa {__version__}")  # the same line as kapitsa.cli's --version callback
        return
    from kapitsa.cli import main as cli_main

    cli_main()
