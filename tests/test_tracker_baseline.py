"""Baseline-aware registration: the paired sign test (pure), and register_best refusing a checkpoint that
did not beat the step-0 eval, in the local and the SkyRL path, against the real MLflow server."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from test_tracker_support import make_peft_adapter
from tracker import RunSession
from rlops.eval_table import outcomes, table_outcomes, table_rows
from tracker.baseline import compare


def test_discordant_mazes_decide_and_the_p_value_is_exact():
    base = {seed: seed < 20 for seed in range(64)}  # 20/64
    better = {seed: seed < 32 for seed in range(64)}  # +12 gained, 0 lost
    result = compare(base, better)
    assert (result.gained, result.lost) == (12, 0) and result.p_value == pytest.approx(0.5**12)
    assert result.beats(0.05) and result.rate == 0.5 and result.base_rate == 20 / 64
    noisy = {seed: (seed < 20 and seed % 5 != 0) or 20 <= seed < 26 for seed in range(64)}  # +6 gained, -4 lost
    result = compare(base, noisy)
    assert (result.gained, result.lost) == (6, 4)
    assert result.p_value == pytest.approx(sum(math.comb(10, k) for k in range(6, 11)) / 1024)
    assert not result.beats(0.05)
    assert result.refusal() == "no checkpoint beat the base: 0.31 vs best 0.34, p=0.38; nothing registered"
    assert not compare(base, base).beats(0.05) and compare(base, base).p_value == 1.0


def test_rows_of_a_logged_table_become_outcomes_and_other_sets_cannot_be_compared():
    rows = table_rows([{"id": 3, "passed": True, "score": 1, "extras": {"steps": 4}},
                       {"id": "b", "passed": 0, "score": 0.25}], step=2)
    assert outcomes(rows) == {"3": True, "b": False}
    # A maze table written before the generic contract (issue 29) reads as the same rows.
    legacy = {"columns": ["seed", "solved", "steps", "final_distance", "step"],
              "data": [[3, True, 4, 0, 2], [5, False, 9, 2, 2]]}
    assert table_outcomes(legacy) == {"3": True, "5": False}
    assert table_outcomes({"columns": list(rows[0]), "data": [list(r.values()) for r in rows]}) == {"3": True, "b": False}
    with pytest.raises(ValueError, match="share no item"):
        compare({"1": True}, {"2": True})


# ---------------------------------------------------------------------------------- against MLflow

def rows(solved: set[int]) -> list[dict]:
    return [{"id": s, "passed": s in solved, "score": float(s in solved), "extras": {"steps": 4}} for s in range(16)]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return make_peft_adapter(tmp_path_factory.mktemp("adapter") / "a")


def test_a_checkpoint_that_does_not_beat_the_base_registers_nothing_and_one_that_does_registers(
        test_config, tmp_path, mlflow_client, adapter):
    source = "maze_2d/local7"
    with RunSession.start(test_config, tmp_path / "flat") as session:
        session.log_eval(source, 6 / 16, rows(set(range(6))), step=0)  # the base
        session.log_checkpoint(adapter, step=5)
        session.log_eval(source, 7 / 16, rows(set(range(1, 8))), step=5)  # +2 gained, -1 lost
        assert session.register_best(source) is None
    refusal = "no checkpoint beat the base: 0.38 vs best 0.44, p=0.5; nothing registered"
    assert session.registration_refused == refusal
    assert mlflow_client.get_run(session.run_id).data.tags["rlops.registration"] == refusal
    assert mlflow_client.search_model_versions(f"name = '{test_config.registered_model}'") == []

    with RunSession.start(test_config, tmp_path / "better") as session:
        session.log_eval(source, 6 / 16, rows(set(range(6))), step=0)
        session.log_checkpoint(adapter, step=5)
        session.log_eval(source, 13 / 16, rows(set(range(13))), step=5)  # +7, p = 2**-7
        version = session.register_best(source)
    assert version is not None and version.tags["rlops.step"] == "5" and session.registration_refused is None
    # the passed test is on the version (tag, description) and the run, as the refusal would have been
    evidence = "base 0.375 vs best 0.812 (7 items gained, 0 lost, p=0.0078)"
    assert session.registration_evidence == evidence
    registered = mlflow_client.get_model_version(test_config.registered_model, version.version)
    assert registered.tags["rlops.beat_base"] == evidence and evidence in registered.description
    assert mlflow_client.get_run(session.run_id).data.tags["rlops.registration"] == (
        f"{test_config.registered_model} v{version.version} (step 5; {evidence})")


def test_the_skyrl_path_compares_the_dumped_per_maze_evals_with_the_step_0_eval(
        test_config, tmp_path, mlflow_client, adapter):
    from tracker.skyrl import TrackerCallback

    export = tmp_path / "export"
    source = "maze_2d/easy"

    def dump(step: int, solved: set[int]) -> None:
        folder = export / "dumped_evals" / f"global_step_{step}_evals"
        folder.mkdir(parents=True)
        entries = [{"data_source": source, "score": float(s in solved), "env_extras": {"extra_info": {"seed": s}}}
                   for s in range(16)]
        (folder / "maze_2d_easy.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
        (folder / "aggregated_results.jsonl").write_text(json.dumps({"eval/all/avg_score": 0.5}) + "\n")

    trainer = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(export_path=str(export))))
    with RunSession.start(test_config, tmp_path / "skyrl") as session:
        callback = TrackerCallback(session, eval_data_source=source)
        for step, solved in ((0, set(range(8))), (2, set(range(9)))):
            dump(step, solved)
            callback.on_eval_end(trainer, SimpleNamespace(global_step=step, metrics={
                f"eval/{source}/avg_score": len(solved) / 16}), None)
        session.log_checkpoint(adapter, step=2)
        callback.on_train_end(trainer, SimpleNamespace(global_step=2), None)
    assert session.registered is None
    assert session.registration_refused == "no checkpoint beat the base: 0.50 vs best 0.56, p=0.5; nothing registered"
