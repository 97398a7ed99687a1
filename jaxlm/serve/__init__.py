"""OpenAI-compatible HTTP server: `python -m jaxlm.serve MODEL` (or `jaxlm serve MODEL`)."""

from jaxlm.serve.cli_args import make_arg_parser

__all__ = ["build_app", "init_app_state", "make_arg_parser", "run_server"]


def __getattr__(name: str):
    # The app imports fastapi and the engine (jax): only when used, so --help stays light.
    if name in ("build_app", "init_app_state", "run_server"):
        from jaxlm.serve import api_server

        return getattr(api_server, name)
    raise AttributeError(f"module 'jaxlm.serve' has no attribute {name!r}")
