"""Session 53, call 3: the 2-job sweep's winners at the 1,024- and 2,048-row rank-64 keys of the H200 table
(bench/results/raw/lora_sweep_*_s53_call2_h200.md). Applied, measured in the 200-step task and backed out
(bench/results/session53_h200.md); kept to redo the edit. Run from the repository root."""
import json

P = "kernels/configs/NVIDIA_H200.json"


def shr(m: int, k: int, r: int, s: int, w: int, st: int) -> dict:
    return {"BLOCK_K": k, "BLOCK_M": m, "BLOCK_R": r, "SPLIT_C": s, "num_stages": st, "num_warps": w}


def wg(m: int, n: int, c: int, r: int, w: int, st: int) -> dict:
    return {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_R": r, "CHUNK": c, "num_stages": st, "num_warps": w}


# (kernel, T_BUCKET, C): (new config, its ms, the old choice's ms): the sweep's CUDA-graph medians of one call
EDITS = {
    ("shrink", 2048, 14336): (shr(64, 128, 64, 8, 4, 3), 0.0221, 0.0247),
    ("shrink_wgrad", 2048, 4096): (shr(128, 64, 64, 8, 8, 4), 0.0200, 0.0211),
    ("shrink_wgrad", 2048, 14336): (shr(128, 64, 64, 8, 8, 4), 0.0447, 0.0563),
    ("wgrad", 2048, 4096): (wg(64, 256, 512, 64, 8, 4), 0.0147, 0.0193),
    ("wgrad", 2048, 14336): (wg(32, 256, 256, 64, 8, 4), 0.0316, 0.0353),
    ("shrink", 1024, 14336): (shr(128, 64, 64, 8, 8, 4), 0.0156, 0.0192),
    ("shrink_wgrad", 1024, 1024): (shr(32, 128, 16, 1, 4, 4), 0.0075, 0.0093),
    ("shrink_wgrad", 1024, 14336): (shr(128, 64, 64, 8, 8, 4), 0.0405, 0.0501),
    ("wgrad", 1024, 4096): (wg(32, 256, 256, 64, 8, 4), 0.0106, 0.0165),
    ("wgrad", 1024, 14336): (wg(32, 256, 256, 64, 8, 4), 0.0222, 0.0297),
}


def main() -> None:
    with open(P) as f:
        table = json.load(f)
    done = set()
    for kernel, rows in table["kernels"].items():
        for row in rows:
            key = row["key"]
            edit = EDITS.get((kernel, key.get("T_BUCKET"), key.get("C")))
            if edit is None or key.get("R_MAX") != 64:
                continue
            new, new_ms, old_ms = edit
            old = row["config"]
            row["config"] = new
            row["timings"] = [{"config": new, "ms": new_ms}, {"config": old, "ms": old_ms}]
            done.add((kernel, key["T_BUCKET"], key["C"]))
    assert done == set(EDITS), set(EDITS) - done
    with open(P, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
