"""``python -m tests.helpers.zygote_child --dir DIR [CODE [SLEEP_S]]``: what a node's process sees at
its start (argv, folder, environment, session, the modules already imported, whether Triton's key
is computed), written to DIR/child.json; a line to stdout and one to stderr; then it sleeps SLEEP_S
and exits with CODE."""

import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    names = ("CUDA_VISIBLE_DEVICES", "LORAPLEX_SLOTS", "TRITON_CACHE_DIR", "PYTHONUNBUFFERED")
    seen = {"argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(), "sid": os.getsid(0),
            "env": {k: os.environ.get(k) for k in names},
            "imported": sorted(m for m in ("torch", "transformers", "trainer.executor", "json")
                               if m in sys.modules),
            "stdin": sys.stdin.read()}
    torch = sys.modules.get("torch")
    seen["cuda_initialized"] = bool(torch is not None and torch.cuda.is_initialized())
    warm = sys.modules.get("kernels.triton_warm")  # Triton's one-time key, inherited from the zygote
    seen["triton_key_cached"] = bool(warm is not None and warm.cached())
    Path(sys.argv[2], "child.json").write_text(json.dumps(seen))
    print("to stdout")
    print("to stderr", file=sys.stderr)
    code = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
    sys.exit(code)
