"""``mariana tune``: model selection with Optuna (TPE sampling, median/Hyperband pruning, resumable studies).

Trials are ``mariana <app> train`` processes (jobs of the job service when one is running); the tuner reads
their ``RUN/metrics.jsonl`` eval records, reports them to Optuna and cancels trials the pruner stops.
"""
