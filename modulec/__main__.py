"""`python -m modulec`: the same command line as the `modulec` script."""

from modulec.cli.main import main

if __name__ == "__main__":
    main()
