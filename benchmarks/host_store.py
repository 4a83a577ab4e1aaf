"""Host store throughput and link-emulation accuracy, on the simulated device.

    python benchmarks/host_store.py [--json out.json]

For each size: the time from swap_out to OUT (device-to-host) and from prefetch to IN (host-to-device), native (no
emulation) and with an emulated link of --link-gbps GB/s, as medians of --repeats runs; the emulated times are
reported as ratios to bytes / bandwidth (1.0 = exact).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPU_BFC_MEM_LIMIT_IN_MB", "4096")

import tensorflow as tf  # noqa: E402

import capuchin_tf  # noqa: E402
from capuchin_tf import HandleStatus  # noqa: E402


def wait_for(handle, status):
    while capuchin_tf.handle_status(handle) != status:
        time.sleep(0.0002)


def time_round_trip(x):
    t0 = time.perf_counter()
    h = capuchin_tf.swap_out(x)
    wait_for(h, HandleStatus.OUT)
    t1 = time.perf_counter()
    capuchin_tf.prefetch(h)
    wait_for(h, HandleStatus.IN)
    t2 = time.perf_counter()
    capuchin_tf.swap_in(h, x.dtype)
    return t1 - t0, t2 - t1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default="1,4,16,64,256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--link-gbps", type=float, default=1.0, help="emulated link, GB/s (1e9 bytes/s)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = []
    for mib in [int(s) for s in args.sizes_mib.split(",")]:
        n = mib << 20
        x = tf.random.stateless_uniform([n // 4], seed=[1, mib])
        row = {"size_bytes": n}
        for regime, bps in (("native", 0.0), ("emulated", args.link_gbps * 1e9)):
            capuchin_tf.set_link_bandwidth(bps)
            time_round_trip(x)  # warm the host buffer pool
            outs, ins = zip(*(time_round_trip(x) for _ in range(args.repeats)))
            row[regime] = {"d2h_s": statistics.median(outs), "h2d_s": statistics.median(ins)}
            if bps:
                row[regime]["d2h_ratio"] = row[regime]["d2h_s"] / (n / bps)
                row[regime]["h2d_ratio"] = row[regime]["h2d_s"] / (n / bps)
        capuchin_tf.set_link_bandwidth(0)
        rows.append(row)
        nat, emu = row["native"], row["emulated"]
        print(f"{mib:5d} MiB  native d2h {n / nat['d2h_s'] / 1e9:6.2f} GB/s  h2d {n / nat['h2d_s'] / 1e9:6.2f} GB/s  |  "
              f"{args.link_gbps:g} GB/s link: d2h {emu['d2h_ratio']:.3f}x  h2d {emu['h2d_ratio']:.3f}x of N/B",
              flush=True)
    result = {"benchmark": "host_store", "date": time.strftime("%Y-%m-%d"), "tf": tf.__version__,
              "machine": {"cores": os.cpu_count(), "platform": platform.platform()},
              "link_gbps": args.link_gbps, "repeats": args.repeats, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
