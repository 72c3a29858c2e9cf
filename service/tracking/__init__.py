"""Tracking integrations: a task's `integrations` (W&B, MLflow) as the API takes and shows them
(schemas), checked and stored with the task (integrations), and written once the task ended, from
the metrics PostgreSQL holds, by the leader's syncer (sync) through one writer per kind
(mlflow_writer: the tracking server's REST API; wandb_writer: offline runs)."""
