"""The `modulec` command line (entry point: `modulec.cli.main:main`)."""
