"""The `ascq` command line: parses arguments and calls into the package; no logic lives here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

try:  # recent typer vendors click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer depends on click
    from click import exceptions as click_exceptions

from ascq.errors import AscqError

app = typer.Typer(
    name="ascq",
    help="Quantize Hugging Face LLM checkpoints into a model zoo and serve them (Ascend NPU, CUDA, CPU).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
zoo_app = typer.Typer(help="List, inspect, verify, document and pull zoo entries.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks against a running server.", no_args_is_help=True)
app.add_typer(zoo_app, name="zoo")
app.add_typer(bench_app, name="bench")


# ---- zoo -------------------------------------------------------------------------------------------------


@zoo_app.command("list")
def zoo_list(
    zoo: Annotated[Optional[Path], typer.Option(help="Zoo folder (default: $ASCQ_ZOO or the project's zoo/).")] = None,
) -> None:
    """Print the zoo's entries as a table."""
    from ascq.zoo.listing import format_table, list_entries

    typer.echo(format_table(list_entries(zoo)))


# ---- entry point -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; user errors are printed as one line `error: ...` with a non-zero exit code."""
    try:
        app(args=argv, standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError:
        sys.exit(0)
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except click_exceptions.ClickException as exc:
        message = " ".join(exc.format_message().split())
        typer.echo(f"error: {message} (see 'ascq --help')", err=True)
        sys.exit(exc.exit_code or 2)
    except AscqError as exc:
        typer.echo(f"error: {' '.join(str(exc).split())}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
