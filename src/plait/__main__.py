"""`python -m plait`: the same command line as the `plait` script."""

from plait.cli import main

raise SystemExit(main())
