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
import threading

import uvicorn
from pydantic import ValidationError

from peagle_jax.compile_cache import enable_compilation_cache
from peagle_jax.serve.config import ServeConfig, build_parser, config_from_args, format_validation_error

log = logging.getLogger("peagle_jax.serve")


def run(app, config: ServeConfig) -> None:
    """Serve `app` with uvicorn until SIGINT/SIGTERM, then drain (see `DrainingServer`)."""
    # uvicorn's own grace period only needs to cover writing the last chunks: the drain itself
    # is the engine's (`DrainingServer.handle_exit`), which ends every stream properly.
    uvicorn_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=config.drain_timeout + FLUSH_GRACE_S, access_log=config.log_level == "debug",
    )
    DrainingServer(uvicorn_config, app.state.engine, config.drain_timeout).run()


#: Seconds uvicorn waits past the drain for streams to send their final chunk and [DONE].
FLUSH_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining through the engine on SIGINT/SIGTERM and exiting with status 0.

    On the signal the engine stops taking requests and in-flight ones get `drain_timeout`
    seconds; whatever is left then ends with finish_reason "abort", so every stream still sends
    its last chunk and `data: [DONE]`. The server keeps listening while it drains, so a new
    request is answered 503 (a client learns the server is going away) instead of finding the
    port closed; once the engine is empty uvicorn closes the connections. A second signal stops
    at once. A drain is a clean stop, so the signal is not re-raised afterwards (uvicorn's
    default would end the process with -SIGTERM).
    """

    def __init__(self, config: uvicorn.Config, engine, drain_timeout: float):
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout
        self.draining = False

    def handle_exit(self, sig, frame) -> None:
        if self.draining:  # a second signal: stop now
            super().handle_exit(sig, frame)
        else:
            self.draining = True
            threading.Thread(target=self._drain, name="peagle-drain", daemon=True).start()
        self._captured_signals.clear()

    def _drain(self) -> None:
        try:
            self.engine.shutdown(self.drain_timeout)  # idempotent: the lifespan calls it again
        finally:
            self.should_exit = True


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
    enable_compilation_cache(config.compilation_cache_dir)
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
