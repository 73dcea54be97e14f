"""`kapitsa bench`: the flags become `BenchOptions`; `kapitsa.bench.command` runs, prints and submits."""

from __future__ import annotations

from collections.abc import Callable

from kapitsa.engine.options import DEFAULT_SPECULATIVE


def cmd_bench(
    *,
    model: str | None,
    json_out: bool,
    submit: bool,
    compare: list[str] | None,
    local: bool,
    quick: bool,
    speculative: str | None,
    results_url: str | None,
    confirm: Callable[[str], bool],
) -> None:
    from kapitsa.bench.command import BenchOptions, bench_main

    options = BenchOptions(
        model=model,
        json_out=json_out,
        submit=submit,
        compare=tuple(compare or ()),
        local=local,
        quick=quick,
        speculative=speculative or DEFAULT_SPECULATIVE,
        results_url=results_url,
    )
    bench_main(options, confirm=confirm)
