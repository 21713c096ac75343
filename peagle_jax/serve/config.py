"""Server configuration: a pydantic model, filled from a YAML file and command-line flags.

Precedence: built-in defaults < ``--config FILE.yaml`` < flags given on the command line.
Unknown YAML keys and out-of-range values are errors (exit status 2 from the CLI).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from peagle_jax.options import Options, add_option_flags, settings_error
from peagle_jax.serve.engine import check_prefill_chunk

__all__ = ["DEFAULT_DRAFTER", "LOOPBACK_HOSTS", "Mesh", "ServeConfig", "build_parser", "config_from_args", "parse_mesh"]

#: Where the trained P-EAGLE head for the default model is expected. Used only when no
#: drafter is configured and the default model is served; when the directory is absent the
#: server falls back to plain decoding (method "none") and logs that it did.
DEFAULT_DRAFTER = "assets/heads/smollm2-135m-peagle"
#: Host names a server without an API key answers by default (IP literals pass as well: a
#: DNS-rebinding page can reach the server only through a host *name*).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_WILDCARD_BINDS = ("0.0.0.0", "::", "")


class Mesh(BaseModel):
    """Device mesh shape: ``data`` x ``model`` devices (``data=D,model=M`` on the command line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    data: int = Field(1, ge=1)
    model: int = Field(1, ge=1)

    @property
    def size(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"data={self.data},model={self.model}"


def parse_mesh(spec: str | dict | Mesh | None) -> Mesh:
    """``"data=2,model=4"`` (either axis may be left out, default 1) -> Mesh."""
    if spec is None:
        return Mesh()
    if isinstance(spec, Mesh):
        return spec
    if isinstance(spec, dict):
        return Mesh(**spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh must look like 'data=D,model=M', got {spec!r}")
    from peagle_jax.sharding import parse_mesh_spec

    axes = parse_mesh_spec(spec.replace(" ", ""))
    return Mesh(**axes)


class ServeConfig(Options):
    """Everything `python -m peagle_jax.serve` can be told (YAML keys = field names): the shared
    `Options` (what to load and how to speculate) and the engine's and HTTP server's settings."""

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)

    # --- engine
    max_batch_size: int = Field(8, ge=1, le=1024)
    max_model_len: int | None = Field(2048, ge=2, description="prompt + completion tokens; None = the model's context")
    max_queue_size: int = Field(64, ge=0)
    max_prefill_batch: int = Field(4, ge=1, description="new requests prefilled together (padded to a power of two)")
    min_prompt_bucket: int = Field(16, ge=1)
    prefill_chunk: int = Field(
        256, ge=1, description="prompt tokens prefilled per engine step: a longer prompt is prefilled in chunks "
        "between other sequences' rounds; a prompt bucket (min_prompt_bucket * 2^i or * 1.5 * 2^i)")
    seed: int = 0
    warmup: bool = Field(True, description="compile every round and prefill shape before accepting requests")
    compilation_cache_dir: str | None = Field(
        None, description="JAX's persistent compilation cache: a restart loads the warm-up's programs instead of "
        "compiling them. Default: one folder per machine kind in the user's cache (peagle_jax.compile_cache); "
        "'off': no cache")
    drain_timeout: float = Field(30.0, ge=0, description="seconds to finish in-flight requests on SIGTERM")
    # --- HTTP
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>' on /v1/*")
    allowed_hosts: list[str] | None = Field(
        None, description="Host header names served ('*' = any, '*.example.com' = subdomains); default: any "
        "with an API key, else the loopback names and the bind address (IP literals always pass)")
    max_request_bytes: int = Field(4 * 2**20, ge=1024, description="largest request body (413 above it)")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _hosts(cls, v: Any) -> Any:
        if isinstance(v, str):  # "a.example.com,b.example.com" from the command line
            v = [h.strip() for h in v.split(",") if h.strip()]
        return v

    def resolved_allowed_hosts(self) -> list[str] | None:
        """The Host names to serve (None: any). Without an API key only loopback names and the
        bind address, so a keyless server cannot be reached through DNS rebinding."""
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        if self.api_key:
            return None
        extra = [] if self.host in _WILDCARD_BINDS or self.host in LOOPBACK_HOSTS else [self.host]
        return list(LOOPBACK_HOSTS) + extra

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("api_key is empty, which would turn authentication off: omit it to serve without a "
                             "key, or give a non-empty key")
        return v

    @model_validator(mode="after")
    def _check_engine(self) -> ServeConfig:
        check_prefill_chunk(self.prefill_chunk, self.min_prompt_bucket)
        return self

    @property
    def mesh_shape(self) -> Mesh:
        return parse_mesh(self.mesh)

    def options(self) -> Options:
        """The settings `load` takes (the shared Options fields of this config)."""
        return Options(**self.model_dump(include=set(Options.model_fields)))

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> ServeConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
        data.update(overrides)
        return cls(**data)


# Flags -> fields. Every flag defaults to None (= "not given"), so YAML values survive.
_FLAGS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--max-batch-size",), dict(type=int, help="concurrent sequences (batch slots)")),
    (("--max-model-len",), dict(type=int, help="prompt + completion tokens per request")),
    (("--max-queue-size",), dict(type=int, help="waiting requests before answering 429")),
    (("--max-prefill-batch",), dict(type=int)),
    (("--prefill-chunk",), dict(type=int, help="prompt tokens prefilled per engine step (default 256): longer "
                                               "prompts are prefilled in chunks between other sequences' rounds")),
    (("--seed",), dict(type=int)),
    (("--no-warmup",), dict(action="store_const", const=False, dest="warmup")),
    (("--compilation-cache-dir",), dict(help="persistent XLA compilation cache (restarts skip the compiles); "
                                       "default: the user's cache, 'off': none")),
    (("--drain-timeout",), dict(type=float, help="seconds to finish in-flight requests on SIGTERM")),
    (("--host",), dict(help="bind address (default 127.0.0.1: localhost only)")),
    (("--port",), dict(type=int)),
    (("--api-key",), dict(help="require this Bearer token on /v1/* (or set PEAGLE_API_KEY)")),
    (("--allowed-hosts",), dict(help="comma-separated Host names to answer ('*' = any; default: any with an API "
                                     "key, else loopback names and the bind address)")),
    (("--max-request-bytes",), dict(type=int, help="largest request body in bytes (default 4 MiB; 413 above)")),
    (("--log-level",), dict(choices=("debug", "info", "warning", "error"))),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m peagle_jax.serve",
        description="OpenAI-compatible server with P-EAGLE / EAGLE-3 speculative decoding.",
    )
    p.add_argument("--config", help="YAML file of settings (flags override it)")
    add_option_flags(p)
    server = p.add_argument_group("engine and HTTP server (peagle_jax.serve.config.ServeConfig)")
    for names, kw in _FLAGS:
        server.add_argument(*names, default=None, **kw)
    return p


def config_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> ServeConfig:
    """Merge YAML (when --config) with the flags that were given. Raises ValueError/ValidationError."""
    overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    if env is not None and "api_key" not in overrides and env.get("PEAGLE_API_KEY"):
        overrides["api_key"] = env["PEAGLE_API_KEY"]
    if args.config:
        return ServeConfig.from_yaml(args.config, **overrides)
    return ServeConfig(**overrides)


def format_validation_error(e: ValidationError) -> str:
    return settings_error(e)
