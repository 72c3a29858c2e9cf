"""OpenAI's fine-tuning API over loraplex tasks: a fine-tuning job IS a task (same id). Its shapes
(schemas), a job create as a native task with the hyperparameters' "auto" (create), and tasks seen
as jobs, events and checkpoints (views); the routes are service.api.routes.fine_tuning."""
