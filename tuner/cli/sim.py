"""``tuner sim serve``: the simulated SGLang server (no GPU needed)."""

from __future__ import annotations

import typer

from tuner.cli.common import app

sim_app = typer.Typer(
    help="The simulated SGLang server (no GPU needed).", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(sim_app, name="sim")


@sim_app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def sim_serve(ctx: typer.Context) -> None:
    """Start the simulated SGLang server; every argument goes to `python -m tuner.sim`.

    It takes sglang.launch_server's flags of the mimicked version plus --sim-* options
    (`tuner sim serve --help` lists them), e.g. `tuner sim serve --model-path llama-3.1-8b
    --sim-gpu H100-80GB --port 30000`.
    """
    from tuner.sim.__main__ import main as sim_main

    raise typer.Exit(sim_main(list(ctx.args), prog="tuner sim serve"))
