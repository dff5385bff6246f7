"""registry_hooks: alias moved in the MLflow registry -> immutable adapter folder + routes manifest in S3.

`sync_model` is the one sync every trigger runs (webhook receiver, reconciler loop, `promote` CLI);
`promote`/`rollback` move an alias safely (copy and verify first) and then sync.
"""
from registry_hooks.operations import gc, list_models, promote, rollback, status
from registry_hooks.sync import NotFound, PromotionError, Refused, SyncConflict, SyncReport, sync_model

__all__ = [
    "NotFound", "PromotionError", "Refused", "SyncConflict", "SyncReport",
    "gc", "list_models", "promote", "rollback", "status", "sync_model",
]
