"""The soak's invariant checker on histories with one planted violation each, and the short soak itself: the
whole system (stack, hooks, Ray Serve with 2 + 2 replicas, tracked training, promotions, client load) under
10 seeded faults, checked on its recorded history."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from soak import check  # noqa: E402

STALENESS_S = 1.0


def answer(sent: float, user: str, version: int | None, status: int = 200, took: float = 0.01) -> dict:
    return {"t": sent + took, "kind": "answer", "sent": sent, "received": sent + took, "user": user,
            "status": status, "version": version, "error": ""}


def clean() -> list[dict]:
    """v1 in production; a canary of v2 from 10 s (user b lands on it) to 20 s; a fault with its 5xx at 30 s."""
    events = [{"t": 0.0, "kind": "intent", "allowed": [1], "generation": 1},
              {"t": 10.0, "kind": "intent", "allowed": [1, 2], "generation": 2},
              {"t": 20.0, "kind": "intent", "allowed": [1], "generation": 3},
              {"t": 30.0, "kind": "fault", "fault_id": 1, "fault": "replica_kill"},
              {"t": 30.5, "kind": "answer", "sent": 30.2, "received": 30.5, "user": "a", "status": 500,
               "version": None, "error": "Internal Server Error"},
              {"t": 32.0, "kind": "converged", "fault_id": 1, "fault": "replica_kill", "seconds": 2.0, "bound_s": 60.0},
              {"t": 40.0, "kind": "end_state", "problems": []}]
    events += [answer(t, "a", 1) for t in (1.0, 5.0, 12.0, 25.0)]
    events += [answer(t, "b", 1) for t in (2.0, 6.0)] + [answer(t, "b", 2) for t in (11.5, 15.0)]
    events += [answer(t, "b", 1) for t in (20.5, 35.0)]  # the canary's end moved b back: within the bound
    return events


def test_a_clean_history_has_no_violation_and_its_figures():
    violations, figures = check(clean(), STALENESS_S)
    assert violations == []
    assert figures["errors_by_cause"] == {"replica_kill": 1} and figures["converge_max_s"] == 2.0
    assert figures["availability_serving_faults"] == 0.0 and figures["availability_outside_faults"] == 1.0


def test_an_answer_from_a_version_the_intent_no_longer_allows_is_named():
    """The planted bug of a flip that skips the staleness wait's bound: v2 still answers 3 s after its canary ended."""
    violations, _ = check(clean() + [answer(23.0, "c", 2)], STALENESS_S)
    assert violations == ["answer at 23.00 s (user c) is v2; the routes intent allowed [1] between 21.50 and "
                          "23.51 s"]


def test_a_user_who_switches_version_without_a_move_is_named():
    events = [e for e in clean() if not (e["kind"] == "intent" and e["generation"] > 1)]
    events = [e for e in events if e.get("user") != "b"] + [answer(3.0, "b", 1)]
    events.append({"t": 0.0, "kind": "intent", "allowed": [1, 2], "generation": 2})  # both allowed all along
    events += [answer(7.0, "b", 2)]
    violations, _ = check(events, STALENESS_S)
    assert violations == ["user b switched v1 -> v2 between 3.00 and 7.00 s without a move"]


def test_a_5xx_outside_any_fault_a_missing_folder_and_a_slow_recovery_are_named_in_time_order():
    events = clean() + [answer(36.0, "a", None, status=502),
                        {"t": 33.0, "kind": "folder_missing", "folder": "m-v1", "generation": 3},
                        {"t": 34.0, "kind": "not_converged", "fault_id": 2, "fault": "s3_kill", "bound_s": 60,
                         "waiting_for": ["S3"]}]
    violations, _ = check(events, STALENESS_S)
    assert violations == ["folder m-v1 was missing at 33.00 s while the manifest (generation 3) referenced it",
                          "s3_kill (fault 2) did not converge within 60 s: ['S3']",
                          "answer at 36.00 s: 502 '' with no fault under way"]


def test_a_move_the_ingress_saw_just_before_s3_died_may_reach_the_watcher_after_it():
    """The short soak's false alarm: a canary's promotion published v2 alone just before an S3 kill; the ingress
    read it, the watcher (every 0.25 s) only once S3 was back. Outside a routes-blind fault the switch is named."""
    events = [{"t": 0.0, "kind": "intent", "allowed": [1, 2], "generation": 1}, answer(1.0, "a", 1),
              {"t": 14.07, "kind": "fault", "fault_id": 5, "fault": "s3_kill"}, answer(13.9, "a", 2),
              {"t": 15.89, "kind": "intent", "allowed": [2], "generation": 2},
              {"t": 16.15, "kind": "converged", "fault_id": 5, "fault": "s3_kill", "seconds": 2.1, "bound_s": 60.0}]
    assert check(events, STALENESS_S)[0] == []
    without_fault = [e for e in events if e.get("fault_id") != 5]
    assert check(without_fault, STALENESS_S)[0] == [
        "user a switched v1 -> v2 between 1.00 and 13.90 s without a move"]


def test_while_the_ingress_cannot_read_s3_an_older_version_is_allowed_until_the_bound_after_it():
    events = clean() + [{"t": 19.0, "kind": "fault", "fault_id": 2, "fault": "s3_stop"},
                        {"t": 23.0, "kind": "converged", "fault_id": 2, "fault": "s3_stop", "seconds": 4.0, "bound_s": 60.0},
                        answer(23.5, "c", 2)]
    assert check(events, STALENESS_S)[0] == []
    assert check(events + [answer(26.0, "d", 2)], STALENESS_S)[0] != []


@pytest.mark.slow
def test_short_soak_ten_faults_no_violation(tmp_path):
    """bench/soak.py on one Ray node (4 logical CPUs; the node kill needs 2 and is the long soak's), 10 faults
    of every other kind; the checker finds nothing and the training run lost no point."""
    history = tmp_path / "history.jsonl"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--nodes", "1", "--faults", "10",
                           "--fault-every", "1.0", "--hold", "1.5", "--seed", "3", "--no-record", "--history", str(history)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    events = [json.loads(line) for line in history.read_text().splitlines()]
    faults = [e["fault"] for e in events if e["kind"] == "fault"]
    assert len(faults) == 10 and len(set(faults)) >= 8, faults
    assert len([e for e in events if e["kind"] == "converged"]) == 10
    assert sum(e["kind"] == "answer" for e in events) > 500
    [end] = [e for e in events if e["kind"] == "end_state"]
    assert end["problems"] == []
    assert "0 violations" in done.stdout


def test_two_overlapping_answers_of_one_user_may_straddle_a_move():
    """The long soak's false alarm: a request stuck on a stopped replica returned the new version after the
    move, while the same user's next request had already returned the old one."""
    events = clean() + [answer(40.0, "e", 1), answer(41.0, "e", 2, took=3.0), answer(41.1, "e", 1),
                        {"t": 43.0, "kind": "intent", "allowed": [2], "generation": 4}]
    assert check(events, STALENESS_S)[0] == []


def test_an_unknown_fault_kind_is_refused_by_name_before_anything_starts():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--kinds", "mlflow_kill,disk_ful"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown fault kinds ['disk_ful']; known: mlflow_kill" in done.stderr


def test_a_node_kill_round_below_one_is_refused_by_name():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--node-kill-rounds", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--node-kill-rounds must be at least 1, got 0" in done.stderr
