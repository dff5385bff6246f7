"""A throwaway embedded stack (MLflow + S3) on free ports for one benchmark run."""
from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rlops import stack
from rlops.config import Config, load_config
from rlops.processes import free_port


@contextmanager
def scratch_stack(**sections: dict) -> Iterator[tuple[Config, Path]]:
    """Yield (config, scratch dir) of a fresh stack; `sections` add keys (e.g. registry={"models": [...]})."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = {"data_dir": str(root / "data"), "server": {"port": free_port()},
                "storage": {"endpoint_url": f"http://127.0.0.1:{stack.free_s3_port()}", "bucket": "bench"}}
        for name, keys in sections.items():
            data[name] = {**data.get(name, {}), **keys}
        (root / "mlflow.yaml").write_text(json.dumps(data))
        config = load_config(root / "mlflow.yaml", environ={})
        stack.up(config, timeout_s=300)  # MLflow needs > 120 s to start under a load average of 10+
        try:
            yield config, root
        finally:
            stack.down(config)
