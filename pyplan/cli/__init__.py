"""Every `pyplan` command: `main` parses the command line and hands each subcommand to its module here."""

from pyplan.cli.main import main

__all__ = ["main"]
