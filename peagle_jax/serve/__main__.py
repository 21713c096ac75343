"""`python -m peagle_jax.serve`: OpenAI-compatible server (completions + chat, SSE streaming).

Examples:
  python -m peagle_jax.serve                                   # default model on 127.0.0.1:8000
  python -m peagle_jax.serve --config configs/serve/smollm2-135m.yaml --port 8080
  python -m peagle_jax.serve --drafter assets/heads/smollm2-135m-peagle --method peagle -k 7
"""

from __future__ import annotations

import logging
import os
import sys

from pydantic import ValidationError

from peagle_jax.serve.config import ServeConfig, build_parser, config_from_args, format_validation_error

log = logging.getLogger("peagle_jax.serve")


def run(app, config: ServeConfig) -> None:
    """Serve `app` with uvicorn until SIGINT/SIGTERM. On a signal uvicorn stops accepting
    connections and gives in-flight requests `drain_timeout` seconds; the app's lifespan then
    stops the engine (whatever is still running ends with finish_reason "abort")."""
    import uvicorn

    uvicorn_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=max(config.drain_timeout, 0.1), access_log=config.log_level == "debug",
    )
    uvicorn.Server(uvicorn_config).run()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, env=dict(os.environ))
    except ValidationError as e:
        print(f"error: invalid configuration: {format_validation_error(e)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding to %s: the server is reachable from other machines%s", config.host,
                    "" if config.api_key else " and has NO API key (--api-key)")
    from peagle_jax.serve.app import create_app

    try:
        app = create_app(config)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run(app, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
