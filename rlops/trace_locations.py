"""Where the endpoint's traces live: the experiments of the configured models' versions (each version's
LoggedModel's) and the base model's experiment. The feedback endpoint searches them and the hooks service's
retention prunes them; one definition for both, since serving and registry_hooks never import each other."""
from __future__ import annotations

from typing import Iterable

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from rlops.layout import version_model_id


def trace_experiments(client: MlflowClient, models: Iterable[str], base_experiment: str) -> set[str]:
    """Experiment ids the ingress may have written traces to."""
    ids = set()
    base = client.get_experiment_by_name(base_experiment)
    if base is not None:
        ids.add(base.experiment_id)
    for model in models:
        model_ids = {version_model_id(v.model_id, v.source) for v in client.search_model_versions(f"name = '{model}'")}
        for model_id in model_ids - {None}:
            try:
                ids.add(client.get_logged_model(model_id).experiment_id)
            except MlflowException:
                continue  # a version whose LoggedModel was deleted
    return ids
