"""`python -m ascq`: the `ascq` command line."""

from ascq.cli import main

main()
