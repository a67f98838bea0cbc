"""``python -m stpc {trace,plan,calibrate,demo,bench} ...`` (the verbs live in ``stpc.cli``)."""
import sys

from stpc.cli import main

if __name__ == "__main__":
    sys.exit(main())
