"""registry_hooks: alias moved in the MLflow registry -> immutable adapter folder + routes manifest in S3.

`registry_hooks.sync.sync_model` is the one sync every trigger runs (webhook receiver, reconciler loop,
`promote` CLI); `registry_hooks.operations` moves an alias safely (copy and verify first) and then syncs.
Nothing is imported here, so the `promote` CLI answers `--help` and usage errors before MLflow loads.
"""
