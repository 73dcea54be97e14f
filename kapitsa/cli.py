"""The `kapitsa` command line: each command parses its flags and calls its body in `kapitsa.commands`.

Heavy modules (mlx, textual, fastapi) are imported inside the command that needs them, so
`kapitsa --help` and `kapitsa --version` stay fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from kapitsa import __version__
from kapitsa.errors import KapitsaError, NotBuilt

app = typer.Typer(
    name="kapitsa",
    help=(
        "Local inference for hybrid Qwen3.5 / Nemotron-H / Flint models on MLX, and a launcher for coding agents."
        "\n\nRun `kapitsa` with no command to open the TUI (models, live stats, bench, agents)."
    ),
    no_args_is_help=False,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)

_state = {"debug": False}

ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Catalog alias (27b, 27b:6bit), HF repo id, folder or .gguf file."),
]
# None: not given, so the settings' mode applies (auto unless KAPITSA_SPECULATIVE or the config
# file says otherwise). The CLI keeps off kapitsa.engine, so `--help` starts fast.
SpecOpt = Annotated[
    str | None,
    typer.Option(
        "--speculative",
        help="auto (the default: drafts when they pay, free when they do not)|ngram|mtp|draft|block|none",
    ),
]
DraftOpt = Annotated[
    str | None,
    typer.Option(
        "--draft",
        help="Drafter: a small model of the same tokenizer (catalog alias, folder or repo id), or a DFlash block drafter folder.",
    ),
]
DraftTokensOpt = Annotated[
    int | None,
    typer.Option("--draft-tokens", help="Longest draft per step (default 7; adaptive below that)."),
]
TreeOpt = Annotated[
    bool | None,
    typer.Option(
        "--tree/--no-tree",
        help="Verify a draft tree instead of a chain (default: what `bench --tune-speculation` measured, else a chain).",
    ),
]
KvBitsOpt = Annotated[
    str | None,
    typer.Option(
        "--kv-bits",
        help="Attention K/V at 8 or 4 bits (about 1/2 or 1/4 of bf16: longer contexts, more conversations "
        "kept); auto: what doctor's fit needs on this machine; off (the default): bf16.",
    ),
]
HostfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--hostfile",
        help="Run the model across the machines of an mlx.launch hostfile (ring or JACCL); see docs/distributed.md.",
    ),
]
ParallelOpt = Annotated[
    str,
    typer.Option(
        "--parallel",
        help="How a --hostfile group splits the model: pipeline (layers) or tensor (heads, experts).",
    ),
]
AgentArgs = Annotated[
    list[str] | None, typer.Argument(help="Arguments passed through to the agent (after --).")
]


def _version(value: bool) -> None:
    if value:
        print(f"kapitsa {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    """With no command, open the TUI."""
    _state["debug"] = debug
    if ctx.invoked_subcommand is None:
        from kapitsa.tui.app import run_tui

        run_tui()


def not_built(what: str) -> NoReturn:
    raise NotBuilt(f"`kapitsa {what}` is not built yet in this version ({__version__}).")


@app.command()
def run(
    prompt_arg: Annotated[
        str | None, typer.Argument(metavar="PROMPT", help="The prompt (or use --prompt / --prompt-file).")
    ] = None,
    model: ModelOpt = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="The prompt text.")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", help="Read the prompt from a file.")
    ] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")
    ] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Maximum tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed.")] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of streaming text.")
    ] = False,
    speculative: SpecOpt = None,
    draft: DraftOpt = None,
    draft_tokens: DraftTokensOpt = None,
    tree: TreeOpt = None,
    kv_bits: KvBitsOpt = None,
    image: Annotated[
        list[Path] | None,
        typer.Option("--image", help="An image file to put before the prompt (repeatable; vision models)."),
    ] = None,
    hostfile: HostfileOpt = None,
    parallel: ParallelOpt = "pipeline",
) -> None:
    """Generate from a prompt and stream the answer."""
    from kapitsa.commands.run import RunOptions, cmd_run

    cmd_run(
        RunOptions(
            model=model,
            prompt=prompt,
            prompt_file=prompt_file,
            prompt_arg=prompt_arg,
            raw=raw,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            json_out=json_out,
            speculative=speculative,
            draft=draft,
            draft_tokens=draft_tokens,
            tree=tree,
            kv_bits=kv_bits,
            images=tuple(image or ()),
            hostfile=hostfile,
            parallel=parallel,
        )
    )


@app.command()
def serve(
    model: ModelOpt = None,
    host: Annotated[
        str | None,
        typer.Option("--host", help="Bind address (default 127.0.0.1). Non-loopback needs KAPITSA_API_KEY."),
    ] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port (default 8484).")] = None,
    speculative: SpecOpt = None,
    draft: DraftOpt = None,
    draft_tokens: DraftTokensOpt = None,
    tree: TreeOpt = None,
    kv_bits: KvBitsOpt = None,
    hostfile: HostfileOpt = None,
    parallel: ParallelOpt = "pipeline",
    reasoning_budget: Annotated[
        int | None,
        typer.Option(
            "--reasoning-budget",
            help="Force </think> after this many thinking tokens (requests without a budget of their own).",
        ),
    ] = None,
) -> None:
    """Serve OpenAI (chat completions, Responses) and Anthropic Messages APIs on 127.0.0.1."""
    from kapitsa.commands.serve import cmd_serve

    cmd_serve(
        model=model,
        host=host,
        port=port,
        speculative=speculative,
        draft=draft,
        draft_tokens=draft_tokens,
        tree=tree,
        kv_bits=kv_bits,
        hostfile=hostfile,
        parallel=parallel,
        reasoning_budget=reasoning_budget,
    )


@app.command()
def doctor(
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable report.")] = False,
    hostfile: HostfileOpt = None,
    parallel: ParallelOpt = "pipeline",
) -> None:
    """Check this machine: GPU, memory, which models fit and with how much context."""
    from kapitsa.commands.doctor import cmd_doctor

    cmd_doctor(json_out, hostfile=hostfile, parallel=parallel)


@app.command()
def pull(model: Annotated[str, typer.Argument(help="Catalog alias or HF repo id.")]) -> None:
    """Download a model into the Hugging Face cache (resumable, verified)."""
    from kapitsa.commands.pull import cmd_pull

    cmd_pull(model)


@app.command("ls")
def list_models(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List downloaded models."""
    from kapitsa.commands.ls import cmd_ls

    cmd_ls(json_out)


@app.command("rm")
def remove_model(model: Annotated[str, typer.Argument(help="Catalog alias or HF repo id.")]) -> None:
    """Delete a downloaded model from the Hugging Face cache."""
    from kapitsa.commands.rm import cmd_rm

    cmd_rm(model)


@app.command()
def bench(
    words: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="compare URL",
            help="`compare URL [URL...]`: bench the local engine (or --no-local) against each OpenAI-compatible URL.",
        ),
    ] = None,
    model: ModelOpt = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
    submit: Annotated[
        bool, typer.Option("--submit", help="Show the results and post them after confirmation.")
    ] = False,
    compare: Annotated[
        list[str] | None,
        typer.Option("--compare", help="Also bench this OpenAI-compatible URL (URL#model picks a model)."),
    ] = None,
    local: Annotated[
        bool, typer.Option("--local/--no-local", help="Bench the local in-process engine too.")
    ] = True,
    quick: Annotated[bool, typer.Option("--quick", help="Small workloads: a fast smoke run.")] = False,
    speculative: SpecOpt = None,
    results_url: Annotated[
        str | None, typer.Option("--results-url", help="Where --submit posts (or KAPITSA_BENCH_RESULTS_URL).")
    ] = None,
    tune_speculation: Annotated[
        bool,
        typer.Option(
            "--tune-speculation",
            help="Time each draft shape (chains, trees) on --model and keep the fastest for run/serve.",
        ),
    ] = False,
    draft: DraftOpt = None,
    workload: Annotated[
        list[str] | None,
        typer.Option(
            "--workload",
            help="Run only this workload (repeat for more): decode_short, decode_long, prefill, "
            "ttft_cold_warm, agent_replay, concurrent_4, speculative.",
        ),
    ] = None,
) -> None:
    """Measure decode/prefill speed, cache hits and concurrency; `bench compare URL...` sets it beside other servers."""
    from kapitsa.commands.bench import cmd_bench, cmd_tune_speculation

    if tune_speculation:
        if workload:
            raise typer.BadParameter("--tune-speculation times its own workload", param_hint="--workload")
        cmd_tune_speculation(model=model, draft=draft, json_out=json_out)
        return

    if words and (words[0] != "compare" or len(words) < 2):
        raise typer.BadParameter("expected `kapitsa bench compare URL [URL...]`", param_hint="compare")
    urls = [*(compare or []), *(words or [])[1:]]
    if not local and not urls:
        raise typer.BadParameter("--no-local needs at least one URL: `bench compare URL` or --compare URL")
    if workload:
        from kapitsa.bench.runner import check_workloads

        try:
            check_workloads(workload)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--workload") from err
    cmd_bench(
        model=model,
        json_out=json_out,
        submit=submit,
        compare=urls,
        local=local,
        quick=quick,
        speculative=speculative,
        results_url=results_url,
        confirm=lambda question: typer.confirm(question, default=False, err=True),
        workloads=workload,
    )


@app.command()
def env(
    shell: Annotated[
        str | None, typer.Option("--shell", help="bash, zsh, fish or powershell (default: detected).")
    ] = None,
) -> None:
    """Print export lines pointing IDEs and SDKs at the local server."""
    from kapitsa.commands.env import cmd_env

    cmd_env(shell)


@app.command()
def token(action: Annotated[str, typer.Argument(help="show | rotate | clear")] = "show") -> None:
    """Manage the API token kept in the OS keyring."""
    from kapitsa.commands.token import cmd_token

    cmd_token(action)


def _agent_command(name: str, summary: str) -> None:
    def command(
        args: AgentArgs = None,
        model: ModelOpt = None,
        speculative: SpecOpt = None,
    ) -> None:
        from kapitsa.commands.agents import cmd_agent

        cmd_agent(name, model, list(args or []), speculative=speculative)

    def pi_command(
        args: AgentArgs = None,
        model: ModelOpt = None,
        speculative: SpecOpt = None,
        restore: Annotated[
            bool, typer.Option("--restore", help="Undo kapitsa's change to pi's models.json.")
        ] = False,
    ) -> None:
        from kapitsa.commands.agents import cmd_agent

        cmd_agent(name, model, list(args or []), speculative=speculative, restore=restore)

    if name == "pi":
        command = pi_command  # type: ignore[assignment]

    command.__doc__ = summary
    app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(command)


_agent_command("claude", "Launch Claude Code on a local model.")
_agent_command("codex", "Launch OpenAI Codex CLI on a local model.")
_agent_command("opencode", "Launch opencode on a local model.")
_agent_command("pi", "Launch the pi coding agent on a local model.")


def main() -> None:
    """Run the CLI; every error, ours or a usage error from the flags, is one `error: ...` line on stderr."""
    try:
        exit_code = app(standalone_mode=False)
    except KapitsaError as err:
        if _state["debug"]:
            raise
        _fail(str(err), 1)
    except _click_exception() as err:
        _fail(_usage_line(err), err.exit_code)  # type: ignore[attr-defined]
    except typer.Abort:  # stdin closed at a prompt (Ctrl-C is Typer's exit 130)
        _fail("aborted", 1)
    sys.exit(exit_code if isinstance(exit_code, int) else 0)


def _click_exception() -> type[Exception]:
    """Click's usage-error base: Typer vendors its own copy of click (`typer._click`) since 0.20."""
    try:
        from typer._click.exceptions import ClickException
    except ImportError:
        from click.exceptions import ClickException
    return ClickException


def _usage_line(err: Exception) -> str:
    message = err.format_message().strip().rstrip(".")  # type: ignore[attr-defined]
    if "Input should be " in message:  # Typer coerces flags with pydantic: keep its verdict, not its prose
        head, _, verdict = message.partition("Input should be ")
        message = f"{head}must be {verdict.split(',')[0]}"
    context = getattr(err, "ctx", None)
    if context is None:
        return message
    return f"{message[:1].lower()}{message[1:]} (see `{context.command_path} --help`)"


def _fail(message: str, exit_code: int) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)
