"""The device model the policies and the simulator plan against. Pure Python: imports no TensorFlow.

What the paper measures (paper.md §1.6, §5) and what this model keeps:

- **compute**: every op takes the time the measured execution recorded for it (the trace's ideal timeline), and a
  recomputation replays ops for exactly their measured durations (recompute cost is measured, not modelled);
- **the link**: ``SwapTime = bytes / bandwidth`` per direction (device-to-host for swap-outs, host-to-device for
  swap-ins), one copy at a time per direction (a GPU's two copy engines; the host store's one worker per
  direction), copies overlapping compute;
- **what a copy takes from compute** (``copy_compute_bytes_per_s``): on a GPU nothing (its copy engines are not its
  cores); on the simulated CPU device every copy is a memcpy the host's cores run beside the step's kernels (an
  emulated link copies at host speed, then holds the buffer until the link's time), and the kernels slow down by about
  the memcpy's time: ``bytes / copy_compute_bytes_per_s`` of compute per copy. The links made by name (``from_link``)
  carry this machine's figure, HOST_COPY_COMPUTE_BYTES_PER_S.

Link regimes (benchmarks.md): ``native`` is this machine's measured host memcpy bandwidth; ``p100`` keeps the paper's
compute-to-transfer ratio: the model's FLOP rate on this machine / 258 FLOP per byte; or a number of bytes/s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

# Host memcpy bandwidth of this machine, per direction, for tensors of 16-64 MiB (docs/results.md, 2026-11-29:
# 5.7-6.3 GB/s device-to-host and 6.0-6.1 GB/s host-to-device).
NATIVE_BYTES_PER_S = 6e9
# A P100 training ResNet-50 achieves about 3.1 TFLOP/s over a 12 GB/s PCIe 3.0 x16 link (benchmarks.md).
P100_FLOP_PER_BYTE = 258.0

# What a copy takes from the step's kernels on this CPU device, per byte copied (docs/decisions.md, "A copy takes
# compute on the CPU device"): plain TensorFlow's ops ran 0.021 s slower in a guided transformer b32 step that copied
# 130 MB (6.2 GB/s) and 0.23 s slower in a bert-base b8 step that copied 2.4 GB (10 GB/s), under one profiler.
HOST_COPY_COMPUTE_BYTES_PER_S = 8e9

LINK_NAMES = ("native", "p100")


class DeviceModelError(ValueError):
    """A link cannot be built (unknown name, bad bandwidth, or a trace without what the regime needs)."""


def link_needs_flops(link: str | float | int) -> bool:
    """Whether the link's model needs the step's FLOP count in the trace's meta (the p100 link does)."""
    return link == "p100"


def link_is_emulated(link: str | float | int) -> bool:
    """Whether copies over this link are slowed down to its bandwidth (every link but `native`, a plain memcpy)."""
    return link != "native"


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """Link bandwidth per direction, in bytes/s. Compute times come from the trace."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    link: str = "custom"
    # Compute a copy takes, per byte (see the module docstring); None: copies take no compute (a GPU's copy engines).
    copy_compute_bytes_per_s: float | None = None

    def __post_init__(self):
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s") + (
                ("copy_compute_bytes_per_s",) if self.copy_compute_bytes_per_s is not None else ()):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and v != float("inf")):
                raise DeviceModelError(f"{name} must be a positive finite number of bytes/s, got {v!r}")

    def copy_compute_time(self, nbytes: int) -> float:
        """The compute time a copy of `nbytes` (either direction) takes from the step's kernels."""
        return nbytes / self.copy_compute_bytes_per_s if self.copy_compute_bytes_per_s else 0.0

    def swap_out_time(self, nbytes: int) -> float:
        """SwapTime of a device-to-host copy."""
        return nbytes / self.d2h_bytes_per_s

    def swap_in_time(self, nbytes: int) -> float:
        """SwapTime of a host-to-device copy."""
        return nbytes / self.h2d_bytes_per_s

    @classmethod
    def symmetric(cls, bytes_per_s: float, link: str = "custom") -> DeviceModel:
        return cls(float(bytes_per_s), float(bytes_per_s), link)

    @classmethod
    def from_link(cls, link: str | float | int, trace=None) -> DeviceModel:
        """``native``, ``p100`` (needs the trace: ``meta["flops"]`` and ``step_time``) or a bandwidth in bytes/s; on
        this CPU device each copy also takes compute (HOST_COPY_COMPUTE_BYTES_PER_S)."""
        return dataclasses.replace(cls._link(link, trace), copy_compute_bytes_per_s=HOST_COPY_COMPUTE_BYTES_PER_S)

    @classmethod
    def _link(cls, link: str | float | int, trace=None) -> DeviceModel:
        if isinstance(link, (int, float)) and not isinstance(link, bool):
            return cls.symmetric(float(link), f"{float(link):g}")
        name = str(link).strip()
        if name == "native":
            return cls.symmetric(NATIVE_BYTES_PER_S, "native")
        if name == "p100":
            if trace is None:
                raise DeviceModelError("the p100 link needs the trace (its FLOP count and step time)")
            flops = (trace.meta or {}).get("flops")
            if flops is None:
                raise DeviceModelError(
                    "the p100 link needs the step's floating-point operation count in the trace's meta['flops'] "
                    "(count it when profiling the model); this trace has none. Use --link native or a bandwidth "
                    "in bytes/s instead."
                )
            try:
                flops = float(flops)
            except (TypeError, ValueError):
                raise DeviceModelError(f"trace meta['flops'] is not a number: {flops!r}") from None
            if flops <= 0 or trace.step_time <= 0:
                raise DeviceModelError(
                    f"the p100 link needs positive meta['flops'] and step_time (got {flops!r}, {trace.step_time!r})"
                )
            return cls.symmetric(flops / trace.step_time / P100_FLOP_PER_BYTE, "p100")
        try:
            bps = float(name)
        except ValueError:
            raise DeviceModelError(
                f"unknown link {link!r}: expected one of {', '.join(LINK_NAMES)} or a bandwidth in bytes/s"
            ) from None
        if not bps > 0 or bps == float("inf"):
            raise DeviceModelError(f"link bandwidth must be a positive number of bytes/s, got {link!r}")
        return cls.symmetric(bps, f"{bps:g}")

    def to_json(self) -> dict:
        return {"link": self.link, "d2h_bytes_per_s": self.d2h_bytes_per_s, "h2d_bytes_per_s": self.h2d_bytes_per_s,
                "copy_compute_bytes_per_s": self.copy_compute_bytes_per_s}

    @classmethod
    def from_json(cls, d: Mapping) -> DeviceModel:
        copy = d.get("copy_compute_bytes_per_s")
        return cls(float(d["d2h_bytes_per_s"]), float(d["h2d_bytes_per_s"]), str(d.get("link", "custom")),
                   None if copy is None else float(copy))
