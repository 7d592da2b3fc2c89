"""``mariana serve``: the parser only (standard library, the CLI helpers and the app registry, so
``mariana --help`` imports neither torch nor numpy). Its handler, `mariana.serving.commands.serve`, is
imported by the CLI's dispatch only when the command runs."""

from __future__ import annotations

from mariana.platform.cli.common import DefaultsHelpFormatter
from mariana.platform.cli.dispatch import handler
from mariana.platform.core.registry import serving_apps


def app_dest(app: str) -> str:
    """The argparse attribute of ``--APP`` (``mlp`` -> ``mlp``, ``a-b`` -> ``a_b``)."""
    return app.replace("-", "_")


def register(sub) -> None:
    """The ``serve`` command under the ``mariana`` subparsers ``sub``: one ``--APP RUN`` flag per servable
    app of the registry, then the server's flags."""
    p = sub.add_parser(
        "serve",
        help="serve trained models over REST (one --APP RUN per app to serve)",
        description="Serve trained models with FastAPI + uvicorn: one --APP RUN flag per servable app. An "
        "app's endpoints answer only when its run directory is given. Binds loopback unless --host says "
        "otherwise.",
        formatter_class=DefaultsHelpFormatter,
    )
    for spec in serving_apps():  # from the app registry: every app with a serving loader and routes
        p.add_argument(
            f"--{spec.name}",
            dest=app_dest(spec.name),
            metavar="RUN",
            help=spec.serve_help or f"{spec.name} run directory",
        )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)"
    )
    wait_help = (
        "micro-batching: longest a request waits for requests already received to share its model call (ms)"
    )
    for flag, kind, default, text in (
        ("--port", int, 8000, "TCP port (0 = any free port; the bound port is printed)"),
        ("--workers", int, 1, "uvicorn worker processes (each loads the models)"),
        ("--threads", int, 0, "torch threads per worker (0 = cores / workers)"),
        ("--max-batch", int, 2048, "most instances per model call (micro-batching)"),
        ("--max-wait-ms", float, 1.0, wait_help),
        ("--max-instances", int, 10_000, "most instances in one request"),
        ("--max-body-bytes", int, 16 << 20, "largest prediction request body"),
        ("--max-upload-bytes", int, 16 << 20, "largest file upload (audio, image)"),
    ):
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument(
        "--watch", action="store_true", help="reload a model when its run dir's model files change"
    )
    p.add_argument(
        "--watch-interval",
        type=float,
        default=None,
        help="seconds between --watch polls (default: 2.0); applies with --watch or --workers > 1 only",
    )
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
    p.add_argument("--runtime", default="torch", choices=["torch", "onnxruntime"],
                   help="run the models in torch, or in ONNX Runtime from RUN/model.onnx (`mariana export`)")  # fmt: skip
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level",
    )
    p.set_defaults(func=handler("mariana.serving.commands:serve"))
