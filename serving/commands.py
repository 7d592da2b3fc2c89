"""Handler of ``mariana serve`` (parser: `cli.py`; uvicorn, the FastAPI app and the model loaders imported at
the top), loaded by `mariana.platform.cli.dispatch` only when the command runs."""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path

import uvicorn
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.listen import bind, check_host
from mariana.platform.core.registry import serving_apps
from mariana.platform.jobs.client import read_token
from uvicorn.supervisors import Multiprocess

from .app import create_app
from .cli import app_dest
from .context import ServeConfig
from .models import load_model


def serve(args: argparse.Namespace, argv: list[str]) -> int:
    """``mariana serve``: check the flags, wait for a first export under --watch, bind --host:--port
    (before loading models, so a busy port fails at once), then serve in this process (--workers 1) or
    in uvicorn worker processes sharing the socket; prints ``serving ... on URL`` once models are loaded."""
    cfg = serve_config(args)
    if cfg.watch:
        wait_for_exports(cfg.models, cfg.watch_interval_s)
    sock = bind(args.host, args.port)
    sock.set_inheritable(True)  # shared with uvicorn's worker processes
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
    if args.workers == 1:
        _serve_here(cfg, sock, common, url)
    else:
        _serve_workers(cfg, sock, common, url, args.workers)
    print("server stopped")
    return 0


_COUNTS = ("workers", "max_batch", "max_instances", "max_body_bytes", "max_upload_bytes")  # flags >= 1


def _check_limits(args: argparse.Namespace) -> None:
    """The numeric flags: counts >= 1, --max-wait-ms and --threads >= 0, --watch-interval > 0, a port."""
    for name in _COUNTS:
        if getattr(args, name) < 1:
            raise MarianaError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.watch_interval is not None and not (args.watch or args.workers > 1):
        raise MarianaError(
            "--watch-interval applies to --watch (or --workers > 1) only: without it no run dir is polled"
        )
    if args.max_wait_ms < 0 or args.threads < 0 or watch_interval(args) <= 0:
        raise MarianaError("--max-wait-ms and --threads must be >= 0, --watch-interval > 0")
    if not 0 <= args.port <= 65535:
        raise MarianaError(f"--port {args.port}: expected 0..65535")


def watch_interval(args: argparse.Namespace) -> float:
    """--watch-interval in seconds (2.0 when not given)."""
    return 2.0 if args.watch_interval is None else args.watch_interval


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The `ServeConfig` of the flags: the run directory of each ``--APP RUN`` given (at least one), the
    limits, the token (required when --host is not loopback) and the --reload-root folders (must exist)."""
    apps = serving_apps()
    models = {s.name: getattr(args, app_dest(s.name)) for s in apps if getattr(args, app_dest(s.name), None)}
    if not models:
        flags = ", ".join(f"--{s.name} RUN" for s in apps)
        raise MarianaError(f"nothing to serve: give at least one of {flags}")
    _check_limits(args)
    token = read_token(args.token_file) if args.token_file else None
    check_host(args.host, token, "requests from other hosts and every /v1/admin request")
    for root in args.reload_root or []:
        if not os.path.isdir(root):
            raise MarianaError(f"--reload-root {root}: no such directory")
    return ServeConfig(
        models=models,
        **{k: getattr(args, k) for k in (*_COUNTS, "max_wait_ms", "threads", "runtime")},
        watch=args.watch or args.workers > 1,  # with several processes, file watching keeps them in step
        watch_interval_s=watch_interval(args),
        reload_roots=[os.path.abspath(r) for r in args.reload_root or []],
        token=token,
    )


def _serve_here(cfg: ServeConfig, sock: socket.socket, common: dict, url: str) -> None:
    """Serve in this process until stopped (--workers 1)."""
    app = create_app(cfg)  # loads the models now: a bad model fails here with a clear message
    server = uvicorn.Server(uvicorn.Config(app, **common))
    # printed once the models are loaded and the port is bound; requests are answered a moment later
    # (scripts poll GET /healthz)
    print(f"serving {', '.join(cfg.models)} on {url} (docs at /docs)", flush=True)
    server.run(sockets=[sock])
    if not server.started:
        raise MarianaError(f"the server on {url} failed to start (see the log lines above)")


def _serve_workers(cfg: ServeConfig, sock: socket.socket, common: dict, url: str, workers: int) -> None:
    """Serve in ``workers`` uvicorn processes sharing ``sock`` until Ctrl-C; each builds its app from
    ``MARIANA_SERVE_CONFIG``. The models are loaded here once first, so a bad one fails before forking."""
    for app, run_dir in cfg.models.items():
        load_model(app, run_dir, cfg.runtime)
    os.environ["MARIANA_SERVE_CONFIG"] = cfg.to_json()
    config = uvicorn.Config("mariana.serving.app:app_from_env", factory=True, workers=workers, **common)
    print(f"serving {', '.join(cfg.models)} with {workers} worker processes on {url}", flush=True)
    try:
        Multiprocess(config, sockets=[sock]).run()  # the workers share the socket bound here
    except KeyboardInterrupt:
        pass


def wait_for_exports(models: dict[str, str], interval_s: float) -> None:
    """``--watch`` on a run that has not exported yet (a stream or a training just started): wait for its
    first ``model.safetensors`` (one line saying so) instead of failing; Ctrl-C stops the wait."""
    waiting = {app: Path(run) for app, run in models.items() if Path(run).is_dir() or not Path(run).suffix}
    waiting = {app: p for app, p in waiting.items() if not (p / "model.safetensors").is_file()}
    if waiting:
        runs = ", ".join(f"--{app} {p}" for app, p in waiting.items())
        print(f"waiting for the first exported model of {runs} (--watch)", flush=True)
    while any(not (p / "model.safetensors").is_file() for p in waiting.values()):
        time.sleep(interval_s)
