"""``python -m stpc {demo,trace,plan,calibrate} ...`` (the verbs live in ``stpc.cli``)."""
import sys

from stpc.cli import main

if __name__ == "__main__":
    sys.exit(main())
