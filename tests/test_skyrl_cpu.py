"""The SkyRL CPU mode (training.skyrl_cpu): every device mapping names the SkyRL 0.3.0 line it serves and
fails loudly when that line changed."""
from __future__ import annotations

import pytest

from training import skyrl_cpu


def test_every_mapping_names_a_line_of_the_installed_skyrl(tmp_path):
    skyrl_cpu.check_seams()  # the pinned skyrl==0.3.0 has every line the mappings were written for
    changed = tmp_path / "skyrl"
    for mapping in skyrl_cpu.MAPPINGS:
        for seam in mapping.seams:
            target = changed / seam.path
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text((skyrl_cpu.skyrl_root() / seam.path).read_text())
    worker = changed / "backends/skyrl_train/workers/worker.py"
    worker.write_text(worker.read_text().replace('backend="cpu:gloo,cuda:nccl"', 'backend="cuda:nccl"'))
    with pytest.raises(skyrl_cpu.SkyRLChanged, match=r"worker\.py:122: expected 'backend=\"cpu:gloo,cuda:nccl\"'"):
        skyrl_cpu.check_seams(changed)
