"""The job service: a database of jobs (SQLAlchemy), a scheduler with a slot budget, a local process-group
executor, a LogStore that copies each run's metrics and counters into the database while the job runs, a
REST API (FastAPI) and the ``mariana submit`` / ``mariana jobs ...`` client commands.

Modules: ``db`` (tables, engine), ``scheduler`` (queue, slots, state machine, recovery), ``executor``
(``Executor`` interface + ``LocalExecutor``), ``runner`` (the tiny wrapper every job runs under),
``logstore`` (file tailing), ``service`` (``create_app``: middleware + the routers of ``routes``, ``studies``
and ``ui``), ``modelservers`` (model servers started from the UI), ``trials`` (an Optuna trial as a row),
``client`` (httpx), ``cli`` (``register``: the parsers), ``commands`` (the client commands' handlers) and ``serve``
(``mariana jobs serve``).
Nothing here is imported by ``mariana --help`` except ``cli``, which imports only the standard library
(and the CLI's dispatch, which imports a handler module when its command runs).
"""
