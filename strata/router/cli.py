"""`strata router`: flags (defaults from RouterConfig), optional local replicas, uvicorn, shutdown.

Wired into the main CLI as a subcommand:
    from strata.router.cli import add_router_args, router_main
    p = sub.add_parser("router", help="cache-aware gateway over data-parallel replicas")
    add_router_args(p); p.set_defaults(func=router_main)
`python -m strata.router [flags]` is the same.

Start-up: check flags; bind the port (a busy port fails before anything starts); with --launch N,
start N `strata serve` replicas and wait until they are ready; register every worker (one health
check each); serve; print one line with the URL. SIGINT/SIGTERM: stop serving (requests in flight
get --grace-period seconds), stop the launched replicas, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import shlex
import socket
import sys
import time

from strata.redact import install_log_redaction, secret_values, with_env_secrets
from strata.router.config import LOG_LEVELS, RouterConfig

logger = logging.getLogger("strata.router")

# not generated from RouterConfig: given their own flags above, or (disaggregation_secret) the engine flag
_SPECIAL = frozenset(
    {
        "worker_urls",
        "policy",
        "log_level",
        "prefill_urls",
        "prefill_policy",
        "disaggregation_secret",
        "service_discovery",
    }
)
GRACE_PERIOD_S = 30.0


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Every `strata router` flag: RouterConfig's fields, --launch and its engine flags."""
    from strata.config import SCALAR_TYPES, add_engine_args, field_comments
    from strata.router.registry import POLICIES

    defaults = RouterConfig()
    comments = field_comments(RouterConfig)
    g = parser.add_argument_group("router")
    g.add_argument(
        "--worker-urls",
        nargs="+",
        default=[],
        metavar="URL",
        help="workers to route to, e.g. http://127.0.0.1:30000 (more can join via POST /workers)",
    )
    g.add_argument(
        "--policy",
        choices=tuple(POLICIES),
        default=defaults.policy,
        help=f"(default: {defaults.policy})",
    )
    g.add_argument(
        "--service-discovery",
        choices=("k8s",),
        default=defaults.service_discovery,
        help="k8s: workers are the Ready pods matching --selector, found and followed through the "
        "Kubernetes API (docs/DEPLOY.md)",
    )
    pd = parser.add_argument_group("prefill/decode disaggregation")
    pd.add_argument(
        "--prefill",
        nargs="+",
        default=[],
        metavar="URL",
        dest="prefill_urls",
        help="prefill workers (`strata serve --disaggregation-mode prefill`); turns on PD "
        "dispatch, which needs the workers' --disaggregation-secret (or STRATA_DISAGG_SECRET)",
    )
    pd.add_argument(
        "--decode",
        nargs="+",
        default=[],
        metavar="URL",
        dest="decode_urls",
        help="decode workers (`strata serve --disaggregation-mode decode`); same as --worker-urls",
    )
    pd.add_argument(
        "--prefill-policy",
        choices=tuple(POLICIES),
        default=defaults.prefill_policy,
        help=f"how to pick the prefill worker (default: {defaults.prefill_policy})",
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, default=defaults.log_level)
    g.add_argument(
        "--grace-period",
        type=float,
        default=GRACE_PERIOD_S,
        help=f"seconds requests in flight may run on after SIGTERM (default: {GRACE_PERIOD_S:.0f})",
    )
    for f in dataclasses.fields(RouterConfig):
        if f.name in _SPECIAL:
            continue
        type_name = str(f.type).replace(" | None", "").strip()
        default = getattr(defaults, f.name)
        suffix = f" (default: {default})" if default is not None else ""
        g.add_argument(
            "--" + f.name.replace("_", "-"),
            type=SCALAR_TYPES[type_name],
            default=default,
            help=comments.get(f.name, "") + suffix,
            metavar=f.name.upper(),
        )
    launch = parser.add_argument_group("local replicas")
    launch.add_argument(
        "--launch",
        type=int,
        default=0,
        metavar="N",
        help="start N local `strata serve` replicas on free ports (with the engine flags below)",
    )
    launch.add_argument(
        "--launch-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for them to be ready",
    )
    launch.add_argument(
        "--replica-args",
        default="",
        metavar="ARGS",
        help="more `strata serve` flags for each replica, as one string, e.g. '--max-queued-requests 64'",
    )
    add_engine_args(parser)  # group "engine": used only with --launch


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ValueError (from RouterConfig) for bad values, e.g. a malformed worker URL."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(RouterConfig)
        if hasattr(args, f.name)
    }
    values["worker_urls"] = tuple(values.get("worker_urls") or ()) + tuple(
        getattr(args, "decode_urls", ()) or ()
    )
    values["prefill_urls"] = tuple(values.get("prefill_urls") or ())
    if values["prefill_urls"] and not values["worker_urls"]:
        raise ValueError("PD dispatch needs decode workers too: give --decode URL ...")
    return RouterConfig(**with_env_secrets(RouterConfig, values))


def router_main(args: argparse.Namespace) -> int:
    """Entry point of `strata router`; returns the process exit status."""
    started = time.perf_counter()
    try:
        config = config_from_args(args)
        if args.launch < 0:
            raise ValueError(f"--launch must be >= 0, got {args.launch}")
        replica_args = shlex.split(args.replica_args or "")
        if config.service_discovery == "k8s":
            from strata.router.k8s_discovery import in_cluster_settings

            in_cluster_settings(
                config.k8s_namespace, config.k8s_api_url
            )  # says which flag is missing
    except ValueError as exc:
        print(f"strata router: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logger.setLevel(
        config.log_level.upper()
    )  # also when the main CLI configured logging first
    install_log_redaction(secret_values(config))
    if not config.worker_urls and not args.launch:
        logger.warning(
            "no workers yet: give --worker-urls or --launch N, or add them with POST /workers"
        )
    from strata.router.launcher import engine_flags, launch_replicas, stop_replicas

    try:
        from strata.server.launch import bind_socket

        sock = bind_socket(config.host, config.port)
    except OSError as exc:
        print(f"strata router: error: {exc}", file=sys.stderr)
        return 2
    replicas = []
    try:
        if args.launch:
            logger.info("starting %d local replicas", args.launch)
            try:
                flags, secret_env = engine_flags(args)
                replicas = launch_replicas(
                    args.launch,
                    flags + replica_args,
                    api_key=config.worker_api_key,
                    secret_env=secret_env,
                    timeout=args.launch_timeout,
                    log_level="warning" if config.log_level != "debug" else "debug",
                )
            except (RuntimeError, TimeoutError) as exc:
                print(f"strata router: error: {exc}", file=sys.stderr)
                return 1
            config = dataclasses.replace(
                config, worker_urls=config.worker_urls + tuple(r.url for r in replicas)
            )
        return asyncio.run(
            _serve(
                config,
                sock,
                frozenset(r.url for r in replicas),
                args.grace_period,
                started,
            )
        )
    except KeyboardInterrupt:
        return 130
    finally:
        stop_replicas(replicas)
        sock.close()


async def _serve(
    config: RouterConfig,
    sock: socket.socket,
    launched: frozenset[str],
    grace: float,
    started: float,
) -> int:
    from strata.router.app import Gateway, create_app

    gateway = Gateway(config, launched_urls=launched)
    from strata.server.launch import make_uvicorn_server

    server = make_uvicorn_server(
        create_app(gateway), config.log_level, grace, keep_alive=30, lifespan="on"
    )
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host

    async def announce() -> None:
        while not server.started:  # noqa: ASYNC110 - uvicorn's flag, no event to await
            await asyncio.sleep(0.05)
        assert gateway.pool is not None
        n, ok = len(gateway.pool.workers), len(gateway.pool.routable())
        print(
            f"strata router: ready at http://{url_host}:{port} (policy {config.policy}, {ok}/{n} workers healthy; "
            f"{time.perf_counter() - started:.1f}s after start)",
            flush=True,
        )

    task = asyncio.ensure_future(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        task.cancel()
    return 0
