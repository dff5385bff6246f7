"""Datasets as run inputs: each train/eval set is logged with `log_inputs` (name = its `data_source`,
digest = its layout hash, source = where it lives), and eval points carry the eval set's name and digest,
so MLflow's dataset filter works on runs, metrics and LoggedModels alike (pure, except `log_datasets`)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag

from tracker.evals import eval_source

# MLflow stores dataset digests (inputs and metric links) in a String(36) column: the layout hash is cut
# to that; its full value goes into the run's params and the registered version's tags.
DIGEST_CHARS = 36
CONTEXT_TAG = "mlflow.data.context"  # MLflow's own input tag: what the run used the set for
TRAINING, EVAL = "training", "eval"
DATASETS_FILE = "datasets.json"  # in the tracker's state dir: a drain or resumed session links evals too


@dataclass(frozen=True)
class DatasetRef:
    """One set a run used. `source` is a path/URI where the file lives, or a description of how the set is
    generated (`source_type="generated"`) when it is built in memory from seeds."""

    name: str  # the data_source
    layout_sha256: str
    source: str
    context: str = EVAL
    source_type: str = "local"
    rows: int | None = None

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"dataset name must be its data_source, got {self.name!r}")
        if len(self.layout_sha256) < DIGEST_CHARS:
            raise ValueError(f"dataset {self.name}: digest {self.layout_sha256!r} is not a layout sha256")
        if self.context not in (TRAINING, EVAL):
            raise ValueError(f"dataset {self.name}: context must be {TRAINING!r} or {EVAL!r}, got {self.context!r}")

    @property
    def digest(self) -> str:
        """The digest as MLflow stores it."""
        return self.layout_sha256[:DIGEST_CHARS]

    def to_input(self) -> DatasetInput:
        source = {"uri": self.source} if self.source_type != "generated" else {"generator": self.source}
        profile = json.dumps({"num_rows": self.rows, "layout_sha256": self.layout_sha256})
        dataset = Dataset(name=self.name, digest=self.digest, source_type=self.source_type,
                          source=json.dumps(source), profile=profile)
        return DatasetInput(dataset, tags=[InputTag(CONTEXT_TAG, self.context)])


class EvalDatasets:
    """The run's eval sets by name: which dataset an eval point is linked to."""

    def __init__(self, refs: Iterable[DatasetRef] = ()):
        self._by_name = {r.name: r for r in refs if r.context == EVAL}

    def link(self, key: str) -> tuple[str, str] | None:
        """(name, digest) for an `eval/<data_source>/<metric>` key of a logged eval set, else None."""
        ref = self._by_name.get(eval_source(key) or "")
        return (ref.name, ref.digest) if ref else None

    def get(self, name: str) -> DatasetRef | None:
        return self._by_name.get(name)


def log_datasets(client: MlflowClient, run_id: str, refs: Iterable[DatasetRef]) -> None:
    """Log the sets as run inputs (MLflow skips an input the run already has, so a resume may repeat it)."""
    inputs = [r.to_input() for r in refs]
    if inputs:
        client.log_inputs(run_id, datasets=inputs)


def store_datasets(state_dir: Path, refs: Iterable[DatasetRef]) -> None:
    """Keep the run's sets beside its state; none given keeps what an earlier session stored."""
    refs = list(refs)
    if not refs:
        return
    path = Path(state_dir) / DATASETS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([asdict(r) for r in refs]))
    os.replace(tmp, path)


def stored_datasets(state_dir: Path) -> list[DatasetRef]:
    path = Path(state_dir) / DATASETS_FILE
    try:
        return [DatasetRef(**r) for r in json.loads(path.read_text())]
    except FileNotFoundError:
        return []
