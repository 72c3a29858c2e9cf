"""An ExecutorConfig from flat keywords, as tests write them: the task's settings
(contract.protocol.TaskSettings fields) go into `settings`, the rest are the executor's own."""

from __future__ import annotations

from typing import Any

from contract.protocol import TaskSettings
from trainer.config import ExecutorConfig, executor_defaults

SETTING_NAMES = ("validation_split", "epochs", "max_seq_len", "seed", "early_exit", "eval", "target_modules")


def executor_config(**kw: Any) -> ExecutorConfig:
    base = executor_defaults()
    settings = {name: kw.pop(name) for name in SETTING_NAMES if name in kw}
    merged = TaskSettings(**{**{n: getattr(base, n) for n in SETTING_NAMES}, **settings})
    return ExecutorConfig(settings=merged, **kw)
