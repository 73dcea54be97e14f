"""Coding-agent launchers: one module per agent, shared server and config-file handling."""
