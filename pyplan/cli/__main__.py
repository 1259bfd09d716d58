"""`python -m pyplan.cli`: the `pyplan` command."""

import sys

from pyplan.cli.main import main, one_command_collector

one_command_collector()
sys.exit(main())
