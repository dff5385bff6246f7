"""serving: an OpenAI-compatible Ray Serve LLM app that routes registry alias names to immutable adapters.

`build_app(config)` builds the app, `run(config, environ)` serves it locally (`rlops serve`), and
`serve_config_v2(config)` is the same app as a RayService `serveConfigV2` (`rlops serve --print-config`);
`check_keys_file(config)` reads the scoped keys file as a replica would and `trace_status(config)` counts
the running endpoint's traces (`rlops status`).
"""
from serving.app import build_app, check_keys_file, run, serve_config_v2, trace_status

__all__ = ["build_app", "check_keys_file", "run", "serve_config_v2", "trace_status"]
