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
    workloads: list[str] | None = None,
) -> None:
    from kapitsa.bench.command import BenchOptions, bench_main
    from kapitsa.bench.runner import WORKLOAD_NAMES

    options = BenchOptions(
        model=model,
        json_out=json_out,
        submit=submit,
        compare=tuple(compare or ()),
        local=local,
        quick=quick,
        speculative=speculative or DEFAULT_SPECULATIVE,
        results_url=results_url,
        workloads=tuple(workloads or WORKLOAD_NAMES),
    )
    bench_main(options, confirm=confirm)


def cmd_tune_speculation(*, model: str | None, draft: str | None, json_out: bool) -> None:
    """Time the draft shapes on `model`, keep the fastest (kapitsa.speculation_tuner), print them."""
    import json
    import sys

    from kapitsa.speculation_tuner import tune_speculation

    def progress(label: str, tok_s: float) -> None:
        if not json_out:
            print(f"{label:>9}  {tok_s:8.1f} tok/s", file=sys.stderr, flush=True)

    result = tune_speculation(model, draft=draft, on_result=progress)
    if json_out:
        print(
            json.dumps(
                {
                    "key": result.key,
                    "kept": result.best_label,
                    "pays": result.pays,
                    "plain_tok_s": round(result.plain_tok_s, 2),
                    "tok_s": {k: round(v, 2) for k, v in result.tok_s.items()},
                    "path": str(result.path),
                }
            )
        )
        return
    best = result.tok_s[result.best_label]
    ratio = best / result.plain_tok_s if result.plain_tok_s else float("nan")
    verdict = "" if result.pays else "; no shape beat plain decoding, so `auto` decodes plainly here"
    print(
        f"kept {result.best_label} for {result.key}: {best:.1f} tok/s, {ratio:.2f}x plain{verdict} ({result.path})"
    )
