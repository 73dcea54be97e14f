"""`kapitsa bench`: standard workloads against an `EngineClient` or any OpenAI-compatible URL.

Headless: importing it loads no UI framework, so the TUI and the CLI share one runner.
"""
