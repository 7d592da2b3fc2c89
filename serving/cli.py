"""``mariana serve`` (stdlib-only imports at module level, so ``mariana --help`` stays fast)."""

from __future__ import annotations

import argparse


def _wait_for_exports(models: dict[str, str], interval_s: float) -> None:
    """``--watch`` on a run that has not exported yet (a stream or a training just started): wait for its
    first ``model.safetensors`` (one line saying so) instead of failing; Ctrl-C stops the wait."""
    import time
    from pathlib import Path

    waiting = {app: Path(run) for app, run in models.items() if Path(run).is_dir() or not Path(run).suffix}
    waiting = {app: p for app, p in waiting.items() if not (p / "model.safetensors").is_file()}
    if waiting:
        runs = ", ".join(f"--{app} {p}" for app, p in waiting.items())
        print(f"waiting for the first exported model of {runs} (--watch)", flush=True)
    while any(not (p / "model.safetensors").is_file() for p in waiting.values()):
        time.sleep(interval_s)


def _serve(args, argv) -> int:
    import os

    from mariana.platform.core.errors import MarianaError
    from mariana.platform.core.registry import serving_apps

    from .app import ServeConfig

    apps = serving_apps()
    models = {s.name: getattr(args, _dest(s.name)) for s in apps if getattr(args, _dest(s.name), None)}
    if not models:
        flags = ", ".join(f"--{s.name} RUN" for s in apps)
        raise MarianaError(f"nothing to serve: give at least one of {flags}")
    for flag, value in (
        ("--workers", args.workers),
        ("--max-batch", args.max_batch),
        ("--max-instances", args.max_instances),
        ("--max-body-bytes", args.max_body_bytes),
        ("--max-upload-bytes", args.max_upload_bytes),
    ):
        if value < 1:
            raise MarianaError(f"{flag} must be >= 1 (got {value})")
    if args.max_wait_ms < 0 or args.threads < 0 or args.watch_interval <= 0:
        raise MarianaError("--max-wait-ms and --threads must be >= 0, --watch-interval > 0")
    if not 0 <= args.port <= 65535:
        raise MarianaError(f"--port {args.port}: expected 0..65535")
    from mariana.platform.jobs.client import read_token

    token = read_token(args.token_file) if args.token_file else None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not token:
        raise MarianaError(
            f"--host {args.host} is reachable from other machines: give --token-file FILE (a secret that "
            "requests from other hosts and every /v1/admin request must present), or bind 127.0.0.1"
        )
    for root in args.reload_root or []:
        if not os.path.isdir(root):
            raise MarianaError(f"--reload-root {root}: no such directory")
    cfg = ServeConfig(
        models=models,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_instances=args.max_instances,
        max_body_bytes=args.max_body_bytes,
        max_upload_bytes=args.max_upload_bytes,
        threads=args.threads,
        workers=args.workers,
        watch=args.watch or args.workers > 1,  # with several processes, file watching keeps them in step
        watch_interval_s=args.watch_interval,
        reload_roots=[os.path.abspath(r) for r in args.reload_root or []],
        token=token,
    )
    if cfg.watch:
        _wait_for_exports(models, args.watch_interval)
    import uvicorn

    sock = _bind(args.host, args.port)  # before loading models: a busy port fails at once
    host, port = args.host, sock.getsockname()[1]  # --port 0: the port the kernel picked
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    common = dict(
        host=host,
        port=port,
        log_level=args.log_level,
        access_log=False,  # a log line per request costs more than a prediction
        timeout_keep_alive=30,
        lifespan="on",
    )
    served = ", ".join(models)
    if args.workers == 1:
        from .app import create_app

        app = create_app(cfg)  # loads the models now: a bad model fails here with a clear message
        server = uvicorn.Server(uvicorn.Config(app, **common))
        # printed once the models are loaded and the port is bound; requests are answered a moment later
        # (scripts poll GET /healthz)
        print(f"serving {served} on {url} (docs at /docs)", flush=True)
        server.run(sockets=[sock])
        if not server.started:
            raise MarianaError(f"the server on {url} failed to start (see the log lines above)")
    else:
        from uvicorn.supervisors import Multiprocess

        from .models import load_model

        for app, run_dir in models.items():  # fail fast, in this process, before forking workers
            load_model(app, run_dir)
        os.environ["MARIANA_SERVE_CONFIG"] = cfg.to_json()
        config = uvicorn.Config(
            "mariana.serving.app:app_from_env", factory=True, workers=args.workers, **common
        )
        print(f"serving {served} with {args.workers} worker processes on {url}", flush=True)
        try:
            Multiprocess(config, sockets=[sock]).run()  # the workers share the socket bound here
        except KeyboardInterrupt:
            pass
    print("server stopped")
    return 0


def _dest(app: str) -> str:
    """The argparse attribute of ``--APP``."""
    return app.replace("-", "_")


def _bind(host: str, port: int):
    """A TCP socket bound to ``host:port`` (port 0: any free port), shared with uvicorn's workers; a port in
    use or an address that is not this machine's is a one-line error."""
    import socket

    from mariana.platform.core.errors import MarianaError

    # proto IPPROTO_TCP, as asyncio's own listening sockets: asyncio sets TCP_NODELAY only on accepted
    # sockets of that proto, and without it small responses wait for the client's delayed ACK (Nagle)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MarianaError(f"--host {host} --port {port}: cannot bind ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` only where there is a default to show (not on the optional run directories)."""

    def _get_help_string(self, action):
        if action.required or action.default in (None, ""):
            return action.help
        return super()._get_help_string(action)


def register(sub) -> None:
    from mariana.platform.core.registry import serving_apps

    fmt = _HelpFormatter
    p = sub.add_parser(
        "serve",
        help="serve trained models over REST (one --APP RUN per app to serve)",
        description="Serve trained models with FastAPI + uvicorn: one --APP RUN flag per servable app. An "
        "app's endpoints answer only when its run directory is given. Binds loopback unless --host says "
        "otherwise.",
        formatter_class=fmt,
    )
    for spec in serving_apps():  # from the app registry: every app with a serving loader and routes
        p.add_argument(
            f"--{spec.name}",
            dest=_dest(spec.name),
            metavar="RUN",
            help=spec.serve_help or f"{spec.name} run directory",
        )
    p.add_argument(
        "--data", metavar="PATH", help="unused by serve (accepted for uniformity with other commands)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)"
    )
    p.add_argument(
        "--port", type=int, default=8000, help="TCP port (0 = any free port; the bound port is printed)"
    )
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (each loads the models)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0 = cores / workers)")
    p.add_argument(
        "--max-batch", type=int, default=2048, help="most instances per model call (micro-batching)"
    )
    p.add_argument(
        "--max-wait-ms",
        type=float,
        default=1.0,
        help="micro-batching: longest a request waits for requests already received to share its model call (ms)",
    )
    p.add_argument("--max-instances", type=int, default=10_000, help="most instances in one request")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="largest prediction request body")
    p.add_argument(
        "--max-upload-bytes", type=int, default=16 << 20, help="largest file upload (audio, image)"
    )
    p.add_argument(
        "--watch", action="store_true", help="reload a model when its run dir's model files change"
    )
    p.add_argument("--watch-interval", type=float, default=2.0, help="seconds between --watch polls")
    p.add_argument(
        "--reload-root",
        action="append",
        metavar="DIR",
        help="POST /v1/admin/reload may switch to run dirs inside DIR only (repeatable; default: the folders "
        "holding the run dirs given)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="file holding a bearer token: /v1/admin requests and every request from another host must send "
        "`Authorization: Bearer TOKEN`; required with a --host other than loopback",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level",
    )
    p.set_defaults(func=_serve)
