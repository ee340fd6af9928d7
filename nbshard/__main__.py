"""``python -m nbshard demo``: see ``nbshard.demo``."""

import sys

from nbshard.demo import main

if __name__ == "__main__":
    if sys.argv[1:2] != ["demo"]:
        sys.exit("usage: python -m nbshard demo [--nproc N] [--steps N]: run a small sharded training job end to end")
    sys.exit(main(sys.argv[2:]))
