"""``python -m nbshard.launcher RUN_DIR``: one node's launcher (``nbshard.process.entry``)."""

if __name__ == "__main__":
    import sys

    from nbshard.process.entry import main

    sys.exit(main(sys.argv[1]))
