"""``python -m batchjob``: the same as the ``batchjob`` command."""

if __name__ == "__main__":
    from batchjob import signals

    signals.install()  # before the imports below: a signal while they run must still end in exit 75

from batchjob.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
