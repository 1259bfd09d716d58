"""`python -m pyplan.cli`: the `pyplan` command."""

import sys

from pyplan.cli.main import main

sys.exit(main())
