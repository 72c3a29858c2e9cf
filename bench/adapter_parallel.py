"""Adapter parallelism vs FSDP2 data parallelism vs one GPU, on a random-weight Qwen2.5-32B shape.

One run, one machine, one table: step throughput of 8 LoRA adapters (rank 16, fp32 adapters, bf16
backbone, gradient checkpointing) at per-adapter batch 1 and 2, seq 256 and 1024, for
(a) adapter parallelism on P GPUs (FSDP2-sharded backbone, 8/P adapters per rank, one step trains
all 8), (b) FSDP2 data parallelism of one adapter at a time on the same P GPUs (the same sharded
backbone; each adapter's batch split over the ranks, its LoRA grads all-reduced; a rank with no
row runs the idle pass: a 1-token forward+backward that joins the all-gathers, and adds zeros to
the all-reduce), (c) the single-GPU engine with all 8 adapters on one GPU (the full model; the
(c) configurations are split over the P GPUs, each GPU running its own). Also: the all-gather
time of one decoder layer alone. Correctness in the same run: every job's first-step loss (B = 0
at init, so the backbone's loss on its first batch) under (a) and (b) equals (c)'s.
Usage: python bench/adapter_parallel.py [--nproc 2] [--layers 64] [--smoke] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RANK, ALPHA, ADAPTERS = 16, 32.0, 8


def model_config(layers: int, smoke: bool):  # noqa: ANN201
    from transformers import Qwen2Config

    if smoke:
        return Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                           max_position_embeddings=4096)
    return Qwen2Config(  # Qwen2.5-32B
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=layers,
        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa",
    )


def init_weights(model, device: torch.device, rank: int, world: int) -> None:  # noqa: ANN001
    """Random weights that do not depend on the sharding: each parameter's full tensor is drawn on
    the GPU from a generator seeded by its (injection-independent) name, then this rank keeps its
    FSDP chunk (dim 0, torch.chunk) -- the sharded and the one-GPU model hold the same values."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            key = name.replace(".base.", ".")
            full = torch.empty(p.shape, dtype=p.dtype, device=device)
            if "norm" in key:
                full.fill_(1.0)
            else:
                g = torch.Generator(device=device).manual_seed(zlib.crc32(key.encode()))
                full.normal_(0.0, 0.02, generator=g)
            if isinstance(p, DTensor):
                chunks = torch.chunk(full, world, dim=0)
                local = p.to_local()
                if rank < len(chunks) and local.numel():
                    local.copy_(chunks[rank])
            else:
                p.copy_(full)
            del full
        rot = model.base_model.rotary_emb  # its inv_freq buffer was emptied by to_empty
        model.base_model.rotary_emb = type(rot)(model.config).to(device)


def examples_of(seq: int, vocab: int, n: int = 64) -> list:
    from trainer.data import Example

    g = torch.Generator().manual_seed(seq)
    return [Example(tuple(r), tuple(r)) for r in torch.randint(8, vocab, (n, seq), generator=g).tolist()]


def spec(i: int, batch: int):  # noqa: ANN201
    from trainer.jobs import TrainJob

    return TrainJob(f"a{i}", lora_rank=RANK, lora_alpha=ALPHA, learning_rate=1e-4, batch_size=batch, max_steps=100_000, seed=i)


def timed(fn, warmup: int, iters: int, sync) -> tuple[float, list[float]]:  # noqa: ANN001
    """Median seconds of fn() after warmup; sync() before each timer read."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


class Ctx:
    """What a rank's phases share: its rank, the device, the barrier-and-sync, the options."""

    def __init__(self, rank: int, world: int, device: torch.device, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.device, self.args = rank, world, device, args
        self.cuda = device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.cfg = model_config(args.layers, args.smoke)
        self.dist = dist

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.dist.barrier()

    def local_sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if self.cuda else 0.0


def sharded_phase(c: Ctx, out: dict) -> None:
    """(a) and (b) on the FSDP2-sharded backbone, and the all-gather time of one layer."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from trainer.engine import MultiLoraEngine
    from trainer.parallel_engine import decoder_layers, shard_engine

    args, dist, rank, world = c.args, c.dist, c.rank, c.world
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(c.cfg, dtype=c.dtype)
    mesh = init_device_mesh(c.device.type, (world,))
    eng = shard_engine(MultiLoraEngine(model, examples_of(args.seqs[0], c.cfg.vocab_size), 0,
                                       adapter_dtype=torch.float32), mesh, c.device)
    model.to_empty(device=c.device)
    init_weights(model, c.device, rank, world)
    c.sync()
    layers = decoder_layers(model)
    layer = layers[len(layers) // 2]

    def gather_layer() -> None:
        layer.unshard()
        layer.reshard()

    out["ag"] = timed(gather_layer, 2, 10, c.sync)[0]
    mine = [i for i in range(ADAPTERS) if i % world == rank]
    for seq in args.seqs:
        eng.train_examples = examples_of(seq, c.cfg.vocab_size)
        for b in args.batches:
            # (a) adapter parallelism: this rank's 8/P adapters; one step trains all 8
            for i in mine:
                eng.attach(spec(i, b))
            c.reset_peak()
            first = eng.step()
            t, _ = timed(eng.step, args.warmup, args.iters, c.sync)
            out["a"][(seq, b)] = (t, {f"a{i}": first.losses[f"a{i}"] for i in mine}, c.peak_gib())
            for j in list(eng.jobs):
                eng.detach(j)
            # (b) data parallelism: adapter after adapter, its batch split over the ranks. All 8
            # live in the engine's arena; each round runs the backbone for one adapter only and
            # all-reduces that adapter's gradient (its region of the gradient arena).
            states = [eng.attach(spec(i, b)) for i in range(ADAPTERS)]
            firsts: dict[str, float] = {}
            c.reset_peak()

            def dp_round(states=states, firsts=firsts, b=b) -> None:  # noqa: ANN001
                for s in states:
                    idx = s.stream.next_indices(b)[rank::world]
                    lo, hi = eng.slots.regions[s.job_id]
                    if idx:
                        rows = [eng.train_examples[k] for k in idx]
                        try:
                            _, sums, counts = eng._forward_losses([s], [rows])  # zeroes the grad arena
                            loss = sums[0] / max(counts[0], 1)
                            loss.backward()
                        finally:
                            eng.slots.clear_layout()
                        firsts.setdefault(s.job_id, float(loss.detach()))
                    else:  # nothing real to do: join the all-gathers with the idle pass
                        eng.slots.grad_arena[lo:hi].zero_()
                        eng.idle_step()
                    grad = eng.slots.grad_arena[lo:hi]
                    dist.all_reduce(grad)
                    grad /= world
                    flat = s.adapter.flat
                    flat.grad = grad.to(flat.dtype)
                    s.optimizer.step()
                    s.optimizer.zero_grad(set_to_none=True)
                    s.scheduler.step()
                    s.step += 1

            t, _ = timed(dp_round, args.warmup_b, args.iters_b, c.sync)
            out["b"][(seq, b)] = (t, dict(firsts) if b == 1 and rank == 0 else {}, c.peak_gib())
            for j in list(eng.jobs):
                eng.detach(j)
            states.clear()
            if c.cuda:
                torch.cuda.empty_cache()


def single_phase(c: Ctx, out: dict) -> None:
    """(c) the whole model on this rank's GPU, all 8 adapters; configurations dealt over ranks."""
    from transformers import AutoModelForCausalLM

    from trainer.engine import MultiLoraEngine

    args = c.args
    configs = [(seq, b) for seq in args.seqs for b in args.batches]
    if c.cuda:  # what the sharded phase left behind (should be ~0)
        print(f"rank={c.rank} allocated before (c): {torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(c.cfg, dtype=c.dtype)
    full.to_empty(device=c.device)
    init_weights(full, c.device, 0, 1)
    one = MultiLoraEngine(full, examples_of(args.seqs[0], c.cfg.vocab_size), 0, adapter_dtype=torch.float32)
    for k, (seq, b) in enumerate(configs):
        if k % c.world != c.rank:
            continue
        one.train_examples = examples_of(seq, c.cfg.vocab_size)
        for i in range(ADAPTERS):
            one.attach(spec(i, b))
        c.reset_peak()
        first = one.step()
        t, _ = timed(one.step, args.warmup, args.iters, c.local_sync)
        out["c"][(seq, b)] = (t, dict(first.losses), c.peak_gib())
        print(f"rank={c.rank} (c) seq={seq} b={b} first losses {list(first.losses.values())[:3]}", flush=True)
        for j in list(one.jobs):
            one.detach(j)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:  # noqa: ANN001
    import gc

    from trainer.parallel import init_rank

    c = Ctx(rank, world, init_rank(rank, world, port), args)
    out: dict = {"rank": rank, "a": {}, "b": {}, "c": {}, "ag": None}
    sharded_phase(c, out)
    gc.collect()
    if c.cuda:
        torch.cuda.empty_cache()
    c.sync()
    single_phase(c, out)
    q.put(out)
    c.dist.barrier()
    c.dist.destroy_process_group()


def table(parts: list[dict], args: argparse.Namespace, world: int, device_name: str) -> tuple[str, float]:
    a, b, c = {}, {}, {}
    first_a: dict = {}
    for p in parts:
        c.update(p["c"])
        for key, (t, losses, mem) in p["a"].items():  # a step lasts as long as its slowest rank
            prev = a.get(key, (0.0, None, 0.0))
            a[key] = max(prev[0], t), None, max(prev[2], mem)
            first_a.setdefault(key, {}).update(losses)
        for key, (t, losses, mem) in p["b"].items():
            prev = b.get(key, (0.0, {}, 0.0))
            b[key] = max(prev[0], t), {**prev[1], **losses}, max(prev[2], mem)
    worst, checked = 0.0, 0
    for key, (_, ref, _) in c.items():
        for job, v in [*first_a[key].items(), *b[key][1].items()]:
            err = abs(v - ref[job]) / abs(ref[job])
            worst = max(worst, err if math.isfinite(err) else math.inf)  # max() would drop a NaN
            checked += 1
    if checked < len(c) * ADAPTERS:
        raise AssertionError(f"only {checked} first-step losses compared")
    ag = max(p["ag"] for p in parts)
    lines = [
        f"# adapter_parallel on {world} x {device_name} (torch {torch.__version__}; "
        f"{'SMOKE: tiny Qwen2 shape' if args.smoke else 'Qwen2.5-32B shape'} with {args.layers} layers, bf16 "
        f"backbone, {ADAPTERS} adapters rank {RANK} fp32, gradient checkpointing; (a),(c): median of "
        f"{args.iters} steps after {args.warmup}; (b): median of {args.iters_b} rounds of {ADAPTERS} adapter "
        f"steps after {args.warmup_b})",
        "",
        f"Command: `python bench/adapter_parallel.py {' '.join(sys.argv[1:])}`",
        "",
        "| seq | batch/adapter | method | s per 8-adapter step | samples/s | tokens/s | peak GiB/GPU | a/b | a/c |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seq in args.seqs:
        for bs in args.batches:
            key = (seq, bs)
            samples = ADAPTERS * bs
            ta, tb, tc = a[key][0], b[key][0], c[key][0]
            for name, (t, _, mem) in (("(a) adapter parallel", a[key]), ("(b) FSDP2 DP, one adapter at a time", b[key]),
                                      ("(c) one GPU, 8 adapters", c[key])):
                ratios = f"{tb / ta:.2f} | {tc / ta:.2f}" if name.startswith("(a)") else " | "
                lines.append(f"| {seq} | {bs} | {name} | {t:.3f} | {samples / t:,.1f} | "
                             f"{samples * seq / t:,.0f} | {mem:.1f} | {ratios} |")
    lines += ["", f"All-gather of one decoder layer (unshard + reshard, median of 10): {ag * 1e3:.2f} ms; "
              f"a step all-gathers every layer twice (forward, backward recompute): "
              f"{2 * args.layers * ag * 1e3:.0f} ms of all-gather per step if none of it overlapped.",
              f"Correctness: first-step losses of (a) and (b, batch 1) vs (c): max rel err {worst:.1e} "
              f"over {checked} losses."]
    return "\n".join(lines), worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--seqs", default="256,1024")
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup-b", type=int, default=1)
    ap.add_argument("--iters-b", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (gloo) to test the script")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.seqs = [int(x) for x in args.seqs.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    if args.smoke:
        args.layers = min(args.layers, 2)
    for k, v in (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"), ("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    import torch.multiprocessing as mp

    from trainer.parallel import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = mp.start_processes(rank_main, args=(args.nproc, free_port(), args, q), nprocs=args.nproc,
                               join=False, start_method="spawn")
    parts = []
    while len(parts) < args.nproc:
        try:
            parts.append(q.get(timeout=1.0))
        except Exception:  # noqa: BLE001 - queue.Empty: check the ranks are alive
            procs.join(timeout=0.01)
    while not procs.join(timeout=1.0):
        pass
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    text, worst = table(parts, args, args.nproc, name)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    tol = 1e-4 if args.smoke else 3e-2
    assert worst < tol, f"first-step losses differ: {worst:.2e} >= {tol}"


if __name__ == "__main__":
    main()
