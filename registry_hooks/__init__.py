"""registry_hooks: alias moved in the MLflow registry -> immutable adapter folder + routes manifest in S3."""
from registry_hooks.sync import NotFound, PromotionError, Refused, SyncConflict, SyncReport, sync_model

__all__ = ["NotFound", "PromotionError", "Refused", "SyncConflict", "SyncReport", "sync_model"]
