"""The bodies of the `kapitsa` commands, one module per command (`kapitsa run` is `commands/run.py`).

`kapitsa/cli.py` parses the flags and calls `cmd_<name>` here; each body calls the package that owns
the work and renders its result. stdout carries results (or JSON); progress and diagnostics go to stderr.
"""
