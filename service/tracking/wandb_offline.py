"""``python service/tracking/wandb_offline.py < runs.json``: write W&B runs in offline mode, one
per item of the JSON's ``runs`` (id, project, entity, name, group, tags, config, history of
{step, metrics}, summary, failed), under its ``dir`` (``<dir>/wandb/offline-run-*``; `wandb
sync` uploads them). A process of its own (service.tracking.wandb_writer starts it): wandb keeps
global state and starts a service process of its own, which the API process must not share.
Exit status 3: wandb is not installed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

NOT_INSTALLED = 3


def main() -> int:
    payload = json.load(sys.stdin)
    root = Path(payload["dir"])
    scratch = Path(payload["scratch"])  # wandb's config, cache and staging, not the runs'
    root.mkdir(parents=True, exist_ok=True)
    os.environ.update({
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(root),
        "WANDB_CONFIG_DIR": str(scratch / "config"), "WANDB_CACHE_DIR": str(scratch / "cache"),
        "WANDB_DATA_DIR": str(scratch / "data"), "WANDB_ARTIFACT_DIR": str(scratch / "artifacts"),
        "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"})
    try:
        import wandb
    except ImportError:
        print("the wandb package is not installed", file=sys.stderr)
        return NOT_INSTALLED
    settings = wandb.Settings(mode="offline", console="off", silent=True, disable_git=True,
                              save_code=False, x_disable_stats=True, x_disable_meta=True,
                              x_disable_machine_info=True, x_save_requirements=False)
    for item in payload["runs"]:
        run = wandb.init(dir=str(root), id=item["id"], project=item["project"],
                         entity=item.get("entity"), name=item["name"], group=item["group"],
                         job_type="lora", tags=item.get("tags") or None, config=item["config"],
                         settings=settings)
        for row in item["history"]:
            run.log(row["metrics"], step=row["step"])
        run.summary.update(item["summary"])
        run.finish(exit_code=1 if item["failed"] else 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
