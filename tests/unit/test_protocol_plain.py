"""contract.protocol on a machine with torch + transformers alone (the GPU image has no pydantic):
the trainer still imports, and the settings it builds by default are the API's defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from contract.protocol import EarlyExitSettings, EvalSettings

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
sys.modules["pydantic"] = None  # as on the GPU image: any import of it fails
import trainer.executor, trainer.launch, trainer.parallel, trainer.objectives  # the training side imports
from contract.protocol import EarlyExitSettings, EvalSettings, JobHyperparameters
from trainer.config import ExecutorConfig
hp = JobHyperparameters(learning_rate=1e-3, lora_rank=4, lora_alpha=8, batch_size=2)
try:
    EarlyExitSettings(windw=3)
    unknown = "accepted"
except TypeError:
    unknown = "refused"
print(json.dumps({"early_exit": EarlyExitSettings().model_dump(), "eval": EvalSettings().model_dump(),
                  "beta": hp.beta, "warmup": EarlyExitSettings(warmup_fraction=0.05).warmup_steps(101),
                  "unknown": unknown, "executor_eval": ExecutorConfig("m", "t", "o", []).settings.eval.model_dump()}))
"""


def test_trainer_imports_without_pydantic_with_the_same_defaults() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["early_exit"] == EarlyExitSettings().model_dump()
    assert got["eval"] == EvalSettings().model_dump()
    assert got["beta"] is None and got["warmup"] == 6 and got["unknown"] == "refused"
    assert got["executor_eval"] == {"eval_every_steps": 10, "eval_max_samples": None,
                                 "eval_every_samples": None, "eval_samples_per_trained": 0.25,
                                 "eval_min_samples": 64}


def test_every_gpu_test_module_imports_without_pydantic() -> None:
    """The GPU image has torch + transformers alone: a GPU test (or a helper it reaches) that needs
    pydantic, FastAPI or SQLAlchemy fails its collection there and stops the whole run."""
    modules = sorted(p.stem for p in (REPO / "tests" / "gpu").glob("test_*.py"))
    probe = ("import importlib, sys\n"
             "for m in ('pydantic', 'fastapi', 'sqlalchemy'):\n    sys.modules[m] = None\n"
             f"for name in {modules!r}:\n    importlib.import_module('tests.gpu.' + name)\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
