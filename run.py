"""Entry point: python run.py ACTION MODEL BACKEND... --variant NAME [flags] (see --help)."""

import sys

from nndf.cli import main

if __name__ == "__main__":
    sys.exit(main())
