"""tracker.hf.TrackerCallback driven by a real transformers Trainer (tiny PEFT Llama, CPU) into real MLflow."""
from __future__ import annotations

import pytest

from test_tracker_support import metric_history
from tracker import RunSession
from tracker.checkpoints import TAG_STEP
from tracker.hf import TrackerCallback, eval_metrics, train_metrics


def test_trl_names_map_onto_skyrl_names():
    logs = {"loss": 0.5, "reward": 0.25, "rewards/maze/mean": 0.25, "learning_rate": 1e-5, "eval_loss": 9.0,
            "train_runtime_str": "1:00"}
    assert train_metrics(logs) == {"policy/final_loss": 0.5, "reward/avg_raw_reward": 0.25,
                                   "rewards/maze/mean": 0.25, "policy/policy_lr": 1e-5}
    assert eval_metrics({"eval_reward": 0.75, "eval_loss": 1.0, "epoch": 1.0}, "maze_2d/local7", "reward") == {
        "eval/maze_2d/local7/avg_score": 0.75, "eval/maze_2d/local7/loss": 1.0}


def test_callback_tracks_a_real_trainer(test_config, tmp_path, mlflow_client):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    rows = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(8)]
    out = tmp_path / "out"
    args = TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
                             eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                             report_to=[], use_cpu=True, disable_tqdm=True, save_total_limit=1)
    with RunSession.start(test_config, out, params=args.to_dict(), tags={"rlops.trainer": "transformers"}) as session:
        trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows[:2],
                          callbacks=[TrackerCallback(session, eval_data_source="maze_2d/local7", score_metric="loss")])
        trainer.train()
        version = session.register_best()

    run_id = session.run_id
    assert mlflow_client.get_run(run_id).info.status == "FINISHED"
    assert [s for s, _ in metric_history(mlflow_client, run_id, "policy/final_loss")] == [1, 2, 3, 4]
    assert [s for s, _ in metric_history(mlflow_client, run_id, "policy/policy_lr")] == [1, 2, 3, 4]
    assert [s for s, _ in metric_history(mlflow_client, run_id, "eval/maze_2d/local7/avg_score")] == [2, 4]
    assert mlflow_client.get_metric_history(run_id, "eval_loss") == []  # eval goes under eval/<data_source>/
    models = mlflow_client.search_logged_models(experiment_ids=[session.experiment_id],
                                                filter_string=f"source_run_id = '{run_id}'")
    # save_total_limit=1 deleted checkpoint-2 right after saving checkpoint-4: the snapshot kept it
    assert sorted(int(m.tags[TAG_STEP]) for m in models) == [2, 4]
    assert not (out / "checkpoint-2").exists()
    assert all("eval/maze_2d/local7/avg_score" in {mm.key for mm in m.metrics} for m in models)
    assert version is not None and version.tags["rlops.metric_key"] == "eval/maze_2d/local7/avg_score"


def test_callback_rejects_a_non_session():
    with pytest.raises(TypeError, match="tracker.RunSession"):
        TrackerCallback(object())
