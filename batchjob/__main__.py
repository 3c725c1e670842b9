"""``python -m batchjob``: the same as the ``batchjob`` command."""

from batchjob.cli import main

if __name__ == "__main__":
    main()
