"""``python -m capuchin_tf bench host-store``: the host store's throughput and the link emulation's accuracy.

    python -m capuchin_tf bench host-store [--sizes-mib 1,4,16,64,256] [--repeats 5] [--link-gbps 1] [--json out.json]

For each size, in a fresh process on a 4096 MiB simulated device: the time from swap_out to OUT (device to host) and
from prefetch to IN (host to device), native (no emulation) and over an emulated link of --link-gbps GB/s, as medians
of --repeats runs; the emulated times are reported as ratios to bytes / bandwidth (1.0 = exact).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from capuchin_tf.cli.common import register_subcommand, run_worker, stamp

DEVICE_MB = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", default="1,4,16,64,256", help="tensor sizes, MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--link-gbps", type=float, default=1.0, help="the emulated link, GB/s (1e9 bytes/s)")
    p.add_argument("--json", help="write the rows there")


def run(args: argparse.Namespace) -> int:
    result = run_worker("host-store-worker", ["--sizes-mib", args.sizes_mib, "--repeats", str(args.repeats),
                                              "--link-gbps", str(args.link_gbps)], DEVICE_MB)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({**stamp(), **result}, indent=1))
        print(f"result written to {args.json}")
    return 0


def _add_worker_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    p.add_argument("--result", required=True)


def _run_worker(args: argparse.Namespace) -> int:
    import tensorflow as tf

    import capuchin_tf
    from capuchin_tf import HandleStatus

    def wait_for(handle, status):
        while capuchin_tf.handle_status(handle) != status:
            time.sleep(0.0002)

    def round_trip(x):
        t0 = time.perf_counter()
        h = capuchin_tf.swap_out(x)
        wait_for(h, HandleStatus.OUT)
        t1 = time.perf_counter()
        capuchin_tf.prefetch(h)
        wait_for(h, HandleStatus.IN)
        t2 = time.perf_counter()
        capuchin_tf.swap_in(h, x.dtype)
        return t1 - t0, t2 - t1

    rows = []
    for mib in [int(s) for s in args.sizes_mib.split(",")]:
        n = mib << 20
        x = tf.random.stateless_uniform([n // 4], seed=[1, mib])
        row = {"size_bytes": n}
        for regime, bps in (("native", 0.0), ("emulated", args.link_gbps * 1e9)):
            capuchin_tf.set_link_bandwidth(bps)
            round_trip(x)  # warms the host buffer pool
            outs, ins = zip(*(round_trip(x) for _ in range(args.repeats)))
            row[regime] = {"d2h_s": statistics.median(outs), "h2d_s": statistics.median(ins)}
            if bps:
                row[regime]["d2h_ratio"] = row[regime]["d2h_s"] / (n / bps)
                row[regime]["h2d_ratio"] = row[regime]["h2d_s"] / (n / bps)
        capuchin_tf.set_link_bandwidth(0)
        rows.append(row)
        nat, emu = row["native"], row["emulated"]
        print(f"{mib:5d} MiB  native d2h {n / nat['d2h_s'] / 1e9:6.2f} GB/s  h2d {n / nat['h2d_s'] / 1e9:6.2f} GB/s  "
              f"|  {args.link_gbps:g} GB/s link: d2h {emu['d2h_ratio']:.3f}x  h2d {emu['h2d_ratio']:.3f}x of N/B",
              flush=True)
    result = {"benchmark": "host-store", "tf_version": tf.__version__, "device_mb": DEVICE_MB,
              "link_gbps": args.link_gbps, "repeats": args.repeats, "rows": rows}
    pathlib.Path(args.result).write_text(json.dumps(result))
    return 0


register_subcommand("host-store-worker", _add_worker_arguments, _run_worker, hidden=True,
                    help="(internal) `bench host-store` in a fresh process")
