"""``python -m tests.helpers.env_dump --dir DIR``: writes the environment variables a node sets
for its executors (worker.processes.spawn) to DIR/env.json, for the tests of what they inherit."""

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    names = ("TRITON_CACHE_DIR", "LORAPLEX_PROFILE_CACHE", "CUDA_VISIBLE_DEVICES", "LORAPLEX_SLOTS")
    Path(sys.argv[2], "env.json").write_text(json.dumps({k: os.environ.get(k) for k in names}))
