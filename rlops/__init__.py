"""rlops: configuration (`rlops.config`), the task contract (`rlops.task`), the embedded stack supervisor and
the CLI of the RL post-training MLOps backbone. Nothing is imported here, so the CLI parses before pydantic
builds the config models."""
