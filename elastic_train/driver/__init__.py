"""Driver side: what `fit()` does in the process that calls it, beside the trainer's own API
(trainer.py).

    arguments.py  the trainer's arguments checked before any actor starts
    launch.py     the supervisor actor started under its run's name, and found again (`attach`)
    follow.py     the supervisor's feed followed and handed to callbacks, run record, progress
    outcome.py    the summary a run ends with turned into its `Result` or the error `fit()` raises
    restore.py    a stored run found again, and the arguments of the trainer that goes on with it
"""
