"""`python -m pipeline.engine ...`: the embedded engine process (how the supervisor starts engines)."""

import sys

from pipeline.engine.serve import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
