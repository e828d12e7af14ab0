"""Throughput of the compression kernels and of the whole compressed-allreduce arithmetic, on one device.

    python recipes/bench_kernels.py                      # the best device here (CUDA if visible)
    python recipes/bench_kernels.py --device cuda --bert # plus the 1-bit overhead vs a BERT-base step

Prints each kernel's best time of ``--repeat`` runs and its effective bandwidth (the bytes it must at least read and
write, over the time), also as a share of the bandwidth of a plain copy. "compressed allreduce arithmetic" is what one
rank of a ``--world``-rank compressed allreduce computes, with local copies in place of the collectives
(``Communicator._loopback``): 16 n bytes (input, worker error read and written, result); "float8 allreduce
arithmetic", the same for an exact step's float8 messages: 8 n bytes. Every kernel here is plain torch.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from hf_zeroone.comm import Communicator
from hf_zeroone.compression import ChunkLayout, compression_error, decompress, pack_signs, segment_scales, unpack_signs


def _timer(device: torch.device, repeat: int) -> Callable[[Callable[[], object]], float]:
    """A function that runs ``fn`` ``repeat`` times after two warm-up runs and returns the best time (s)."""

    def measure(fn: Callable[[], object]) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(repeat):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return min(times)  # the best run: robust to other work on a shared machine

    return measure


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def bench(
    device: torch.device, numel: int, world: int, repeat: int, segments: int, rows: bool = True, masked: float = 0.0
) -> dict:
    """Time every kernel on ``numel`` float32 elements (only the inline arithmetic if not ``rows``).

    ``masked``: the fraction of the elements the layout masks (drawn at random, a fixed seed), as the
    automatic momentum mask masks unused embedding rows; 0 masks only the padding.
    """
    measure = _timer(device, repeat)
    n = numel - numel % (8 * world) or 8 * world
    starts = [i * n // segments for i in range(1, segments)]
    keep = torch.rand(n, generator=torch.Generator().manual_seed(0)) >= masked if masked > 0 else None
    layout = ChunkLayout.from_mask(n, world, keep, device, segment_starts=starts)
    x = torch.randn(n, device=device)
    dst = torch.empty_like(x)
    packed = pack_signs(x)
    scales = segment_scales(x, layout.bounds, layout.segment_counts)
    out = torch.empty_like(x)
    we, se = torch.zeros(layout.padded, device=device), torch.zeros(layout.chunk, device=device)
    inline = Communicator._loopback(world, rank=world - 1, threaded=False)
    threaded = Communicator._loopback(world, rank=world - 1, threaded=True)
    eager = Communicator._loopback(world, rank=world - 1, threaded=False)
    eager._graphs = None  # every operation dispatched on its own, as with HF_ZEROONE_CUDA_GRAPHS=0
    buf = torch.empty_like(x)

    def arithmetic(comm: Communicator) -> Callable[[], object]:
        def run() -> object:
            buf.copy_(x)
            return comm.compressed_allreduce(buf, we, se, layout)

        return run

    sizes = [b - a for a, b in zip((0, *starts), (*starts, n))]  # the segments as a bucket's tensors

    def float8_arithmetic() -> object:
        buf.copy_(x)
        return inline.float8_allreduce_async(buf, sizes).wait()

    if not rows:
        seconds, eager_s = measure(arithmetic(inline)), measure(arithmetic(eager))
        threaded.close()
        return {"arithmetic_s": seconds, "eager_s": eager_s}
    copy_s = measure(lambda: dst.copy_(x))
    f = 4 * n  # bytes of one float32 vector
    cases = [
        ("copy (reference)", lambda: dst.copy_(x), 2 * f),
        ("pack_signs", lambda: pack_signs(x), f + n // 8),
        ("unpack_signs", lambda: unpack_signs(packed), n // 8 + f),
        ("segment_scales", lambda: segment_scales(x, layout.bounds, layout.segment_counts), f),
        ("compression_error", lambda: compression_error(x, scales, layout.bounds, out=out), 2 * f),
        ("decompress", lambda: decompress(packed, scales, layout.bounds), n // 8 + f),
        (f"compressed allreduce arithmetic (P={world})", arithmetic(inline), 4 * f),
        (f"  same, through the worker thread (P={world})", arithmetic(threaded), 4 * f),
        *([(f"  same, without CUDA graphs (P={world})", arithmetic(eager), 4 * f)] if device.type == "cuda" else []),
        (f"float8 allreduce arithmetic (P={world}, exact steps)", float8_arithmetic, 2 * f),
    ]
    table = []
    copy_gbs = 2 * f / copy_s / 1e9
    for name, fn, nbytes in cases:
        seconds = copy_s if name.startswith("copy") else measure(fn)
        gbs = nbytes / seconds / 1e9
        table.append({"kernel": name, "ms": seconds * 1e3, "GB/s": gbs, "of_copy": gbs / copy_gbs})
    threaded.close()
    arith_s = next(r["ms"] for r in table if r["kernel"].startswith("compressed")) / 1e3
    masked_n = n - int(layout.segment_counts.sum().item())  # elements the layout masks (the padding is none here)
    return {"device": device_name(device), "numel": n, "world": world, "copy_GB/s": copy_gbs, "rows": table,
            "arithmetic_s": arith_s, "masked": masked_n}  # fmt: skip


def bert_step_seconds(device: torch.device, batch: int, seq: int, repeat: int) -> tuple[float, int, int]:
    """Best seconds of a BERT-base (masked LM) forward + backward; its parameters and tensors."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig()).to(device)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    params = list(model.parameters())
    return _timer(device, repeat)(step), sum(p.numel() for p in params), len(params)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, default=0, help="elements (default: 2^26 on CUDA, 2^22 on CPU)")
    parser.add_argument("--world", type=int, default=8, help="simulated ranks of the compressed allreduce")
    parser.add_argument("--segments", type=int, default=16, help="tensors (segments) in the vector")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--masked", type=float, default=0.0, help="fraction of the elements masked (unused rows)")
    parser.add_argument("--bert", action="store_true", help="also time a BERT-base forward + backward")
    parser.add_argument("--bert_batch", type=int, default=32)
    parser.add_argument("--bert_seq", type=int, default=128)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    numel = args.numel or (1 << 26 if device.type == "cuda" else 1 << 22)
    if not 0.0 <= args.masked < 1.0:
        parser.error(f"--masked is a fraction of the elements, in [0, 1); got {args.masked}")
    res = bench(device, numel, args.world, args.repeat, args.segments, masked=args.masked)
    print(f"device: {res['device']}; memory bandwidth (plain copy): {res['copy_GB/s']:.1f} GB/s")
    print(f"n = {res['numel']} float32 elements, {args.segments} segments, {args.masked:.0%} masked\n")
    print("| kernel | ms | GB/s | of memory bandwidth |")
    print("|---|---:|---:|---:|")
    for row in res["rows"]:
        print(f"| {row['kernel']} | {row['ms']:.3f} | {row['GB/s']:.1f} | {100 * row['of_copy']:.1f}% |")
    print(
        "\nGB/s: the least bytes each operation must read + write, over its time (the 1-bit arithmetic: 16 n "
        "bytes, the float8 one 8 n; their times include copying the input into the scratch buffer)."
    )
    if args.bert:
        step_s, params, tensors = bert_step_seconds(device, args.bert_batch, args.bert_seq, max(3, args.repeat // 2))
        # as DDP would bucket it (25 MB buckets): the arithmetic of one bucket, times the buckets
        bucket = 25 * 2**20 // 4
        buckets = -(-params // bucket)
        one = bench(device, bucket, args.world, max(3, args.repeat // 2), -(-tensors // buckets), rows=False)
        overhead, eager_s = one["arithmetic_s"] * buckets, one["eager_s"] * buckets
        res["bert"] = {"params": params, "step_s": step_s, "compression_s": overhead, "ratio": overhead / step_s,
                       "eager_ratio": eager_s / step_s}  # fmt: skip
        print(
            f"\nBERT-base forward + backward (batch {args.bert_batch} x {args.bert_seq}): {step_s * 1e3:.1f} ms; "
            f"1-bit compression arithmetic for its {params / 1e6:.0f}M parameters ({buckets} buckets of 25 MB, "
            f"P={args.world}): {overhead * 1e3:.1f} ms = {100 * overhead / step_s:.1f}% of the step (goal: under 7%)"
        )
        if device.type == "cuda":
            print(f"without CUDA graphs: {eager_s * 1e3:.1f} ms = {100 * eager_s / step_s:.1f}% of the step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
