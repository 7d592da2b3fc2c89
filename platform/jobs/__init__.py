"""The job service and the ``mariana submit`` / ``mariana jobs ...`` client commands (``README.md`` here).

Nothing here is imported by ``mariana --help`` except ``cli``, which imports only the standard library
(and the CLI's dispatch, which imports a handler module when its command runs).
"""
