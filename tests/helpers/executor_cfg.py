"""An ExecutorConfig from flat keywords, as tests write them: the task's settings
(contract.protocol.TaskSettings fields) go into `settings`, the rest are the executor's own."""

from __future__ import annotations

from typing import Any

from contract.protocol import TaskSettings
from trainer.config import ExecutorConfig, executor_defaults

SETTING_NAMES = tuple(TaskSettings.model_fields)  # any setting added later included


def executor_config(**kw: Any) -> ExecutorConfig:
    base = executor_defaults()
    settings = {name: kw.pop(name) for name in SETTING_NAMES if name in kw}
    merged = TaskSettings(**{**{n: getattr(base, n) for n in SETTING_NAMES}, **settings})
    return ExecutorConfig(settings=merged, **kw)
