"""The handler of ``mariana jobs serve`` (parser in ``cli.py``): the job service (FastAPI under uvicorn) on
a socket bound here, so a bad --host/--port is one clear line before anything starts."""

from __future__ import annotations

import os

import uvicorn
from mariana.platform.cli.main import build_parser, check_command
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.listen import bind, check_host
from sqlalchemy.exc import ArgumentError, OperationalError

from .client import read_token
from .service import create_app
from .slurm import executor_from_args


def serve(args, argv) -> int:
    """``mariana jobs serve``: the job service on ``--host --port`` until interrupted."""
    token = read_token(args.token_file) if args.token_file else None
    check_host(args.host, token, "every mutating request")
    if args.slots is not None and args.slots < 1:
        raise MarianaError(f"--slots {args.slots}: expected >= 1")
    if not 0 <= args.port <= 65535:
        raise MarianaError(f"--port {args.port}: expected 0..65535")
    home = os.path.expanduser(args.home)
    try:
        os.makedirs(home, exist_ok=True)
    except OSError as e:
        raise MarianaError(f"--home {args.home}: {e.strerror}") from None
    sock = bind(args.host, args.port)
    sock.listen(128)  # connections wait in the backlog while the service starts
    port = sock.getsockname()[1]
    executor = None
    if args.executor == "slurm":
        executor = executor_from_args(args)
    elif args.partition or args.account or args.sbatch_arg:
        raise MarianaError("--partition/--account/--sbatch-arg need --executor slurm")
    try:
        app = create_app(home, args.db_url, args.slots, token, executor=executor, build_parser=build_parser,
                         check=check_command)  # fmt: skip
    except (ArgumentError, OperationalError) as e:
        raise MarianaError(f"--db-url {args.db_url}: {str(e).splitlines()[0]}") from None
    except ModuleNotFoundError as e:
        raise MarianaError(
            f"--db-url {args.db_url}: the database driver {e.name!r} is not installed"
        ) from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"mariana jobs service on http://{host}:{port} (home {home}, {app.state.scheduler.slots} slots, "
          f"{args.executor} executor, docs at /docs)", flush=True)  # fmt: skip
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
    return 0
