"""The job service: a database of jobs (SQLAlchemy), a scheduler with a slot budget, a local process-group
executor, a LogStore that copies each run's metrics and counters into the database while the job runs, a
REST API (FastAPI) and the ``mariana submit`` / ``mariana jobs ...`` client commands.

Modules: ``db`` (tables, engine), ``scheduler`` (queue, slots, state machine, recovery), ``executor``
(``Executor`` interface + ``LocalExecutor``), ``runner`` (the tiny wrapper every job runs under),
``logstore`` (file tailing), ``service`` (``create_app``), ``client`` (httpx), ``cli`` (``register``).
Nothing here is imported by ``mariana --help`` except ``cli``, which imports only the standard library.
"""
