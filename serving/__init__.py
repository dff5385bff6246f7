"""serving: an OpenAI-compatible Ray Serve LLM app that routes registry alias names to immutable adapters.

`build_app(config)` builds the app, `run(config, environ)` serves it locally (`rlops serve`), and
`serve_config_v2(config)` is the same app as a RayService `serveConfigV2` (`rlops serve --print-config`).
"""
from serving.app import build_app, run, serve_config_v2

__all__ = ["build_app", "run", "serve_config_v2"]
