"""`python -m patrl.orchestrator.demo`: the same command as `python -m patrl.demo`."""

import sys

from patrl.demo.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
