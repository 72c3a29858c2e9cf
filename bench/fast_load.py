"""The backbone onto the GPU in a fresh process (issue 41: weights at the page cache's speed): the
time from this process's start to the imports, to CUDA being ready, and to the model on the device
through trainer.fast_load (pinned staging, parallel readers), with GB/s. Run it twice in a row: the
second run reads from the page cache. Checks a few tensors against the files.

    python bench/fast_load.py MODEL_DIR [--threads 8] [--json FILE]
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers  # noqa: E402, F401

from trainer.fast_load import load_to_device, shard_files  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--json", default="")
    ap.add_argument("--parts", action="store_true", help="first time the build on the device and the file reads alone")
    args = ap.parse_args()
    t_import = time.perf_counter() - T0
    torch.cuda.init()
    torch.empty(1, device="cuda")
    t_cuda = time.perf_counter() - T0
    parts = {}
    if args.parts:  # the load's parts, each alone first: the model built on the device from its
        # config (weights initialised there), and the shard files read from the page cache (pread)
        from transformers import AutoConfig, AutoModelForCausalLM

        t1 = time.perf_counter()
        with torch.device("cuda"):
            built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_dir), dtype=torch.bfloat16)
        torch.cuda.synchronize()
        parts["build_on_device_s"] = round(time.perf_counter() - t1, 2)
        del built
        torch.cuda.empty_cache()
        t1, total = time.perf_counter(), 0
        buf = bytearray(64 << 20)
        for f in shard_files(Path(args.model_dir)):
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    total += n
        parts["read_files_s"] = round(time.perf_counter() - t1, 2)
        parts["read_gb_per_s"] = round(total / 1e9 / parts["read_files_s"], 2)
    t1 = time.perf_counter()
    model = load_to_device(args.model_dir, torch.device("cuda"), torch.bfloat16, threads=args.threads)
    torch.cuda.synchronize()
    t_load = time.perf_counter() - t1
    assert model is not None
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    from safetensors import safe_open

    ok = True
    for f in shard_files(Path(args.model_dir))[:2]:
        with safe_open(str(f), framework="pt") as sf:
            for n in list(sf.keys())[:3]:
                ok &= bool(torch.equal(sf.get_tensor(n).cuda(), model.state_dict()[n]))
    res = {"import_s": round(t_import, 2), "cuda_ready_s": round(t_cuda, 2), "load_s": round(t_load, 2),
           "on_device_s": round(time.perf_counter() - T0, 2), "gb": round(nbytes / 1e9, 2),
           "gb_per_s": round(nbytes / 1e9 / t_load, 2), "threads": args.threads, "tensors_equal_files": ok, **parts}
    print(json.dumps(res))
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps(res) + "\n")
    assert ok


if __name__ == "__main__":
    main()
