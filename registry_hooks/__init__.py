"""registry_hooks: alias moved in the MLflow registry -> immutable adapter folder + routes manifest in S3."""
