"""``python -m nbshard.worker RUN_DIR``: one rank (``nbshard.process.worker``).

The command line every rank shows, cold or forked; kept short so that running jobs and
docs that name it keep working. Its ``__main__`` holds the notebook's names alone.
"""

if __name__ == "__main__":
    from nbshard.process.worker import run_as_main

    run_as_main(vars())

if __name__ == "__mp_main__":  # a spawn-started child of a rank, e.g. a DataLoader worker
    from nbshard.process.worker import restore_notebook_main

    restore_notebook_main(vars())
