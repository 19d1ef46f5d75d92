"""`aml-app simulate-amlworld DIR`: write a run of the AMLworld-calibrated simulator in AMLworld's layouts
(`aml_app.simulation.calibrated`), for `aml-app import-amlworld` and `bench.amlworld_detection`."""

from __future__ import annotations

from pathlib import Path

import click

from aml_app.click_types import POSITIVE
from aml_app.simulation.calibrated import simulate_calibrated


@click.command("simulate-amlworld")
@click.argument("directory", type=click.Path(file_okay=False, writable=True, path_type=Path))
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--days", type=POSITIVE, default=14.0, show_default=True)
@click.option(
    "--per-hour",
    type=POSITIVE,
    default=400.0,
    show_default=True,
    help="Background payments per hour of event time.",
)
@click.option(
    "--attempts",
    type=click.IntRange(min=0),
    default=40,
    show_default=True,
    help="Laundering attempts of each of the eight typologies.",
)
@click.option(
    "--accounts",
    type=click.IntRange(min=100),
    default=None,
    help="Accounts of the run (default: about ten payments per account, as in AMLworld).",
)
def simulate_amlworld_command(
    directory: Path, seed: int, days: float, per_hour: float, attempts: int, accounts: int | None
) -> None:
    """Write DIR/Trans.csv (background) and DIR/Patterns.txt (laundering attempts) of one seeded run of
    the simulator calibrated to AMLworld's real rows."""
    run = simulate_calibrated(seed, days=days, per_hour=per_hour, attempts=attempts, accounts=accounts)
    try:
        transactions, patterns = run.write(directory)
    except OSError as exc:
        raise click.ClickException(f"could not write {exc.filename}: {exc.strerror}.") from None
    laundering = sum(len(a.rows) for a in run.attempts)
    click.echo(f"simulate-amlworld: {len(run.background)} background payment(s) in {transactions}")
    click.echo(f"simulate-amlworld: {len(run.attempts)} attempt(s), {laundering} payment(s) in {patterns}")
    click.echo(f"send them with: aml-app import-amlworld {transactions} {patterns} --days-per-second 1")
