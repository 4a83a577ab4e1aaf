"""What every subcommand shares: the registry of subcommands and the one-line user error.

Subcommands register themselves with ``register_subcommand(name, add_arguments, run, help=...)``: ``add_arguments``
fills an argparse sub-parser, ``run(args)`` does the work and returns an exit code (or None for 0), raising
``CliError`` for a user mistake (printed as ``capuchin_tf <name>: error: ...``, exit code 2). Imports no TensorFlow.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping

from capuchin_tf.core.budget import MiB, parse_budget
from capuchin_tf.tf.simulated_device import simulated_device_env


class CliError(Exception):
    """A user mistake (bad argument, missing file...): reported in one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]
    hidden: bool = False  # internal (a worker the parent process starts): not listed in --help


SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(
    name: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int | None],
    *,
    help: str = "",
    hidden: bool = False,
    replace: bool = False,
) -> None:
    """Adds `name` to the command line (see the module docstring)."""
    if name in SUBCOMMANDS and not replace:
        raise ValueError(f"subcommand {name!r} is already registered")
    SUBCOMMANDS[name] = Subcommand(name, help, add_arguments, run, hidden)


# One syntax for every size on the command line: a number of MiB (what the flags' `-mb` says), or a size with its
# unit as `capuchin_tf.function(memory_budget=...)` takes it ("2GiB", "512MiB", "1073741824B"; core.budget).
SIZE_HELP = "MiB, or a size with its unit (2GiB, 512MiB)"


def _size_bytes(text: str, what: str) -> int:
    text = str(text).strip()
    try:
        return int(float(text) * MiB)
    except (ValueError, OverflowError):  # not a number, or nan / inf
        pass
    try:
        return parse_budget(text)
    except (TypeError, ValueError):
        raise CliError(f"{what} must be {SIZE_HELP}, got {text!r}") from None


def mib_arg(text: str, what: str, *, positive: bool = False) -> int:
    """A size given on the command line (SIZE_HELP), in bytes: finite and >= 0 (at least one byte when `positive`)."""
    try:
        v = float(str(text).strip())
    except ValueError:
        v = None
    if v is not None and (not v >= 0 or v == float("inf")):
        raise CliError(f"{what} must be a {'positive' if positive else 'non-negative'} size, got {text!r}")
    value = _size_bytes(text, what)
    if positive and value <= 0:
        raise CliError(f"{what} must be a positive size, got {text!r}")
    return value


def whole_mib(text: str) -> int:
    """argparse type of a device size or a benchmark budget (SIZE_HELP): a whole number of MiB (the simulated
    device's limit is set in MiB)."""
    try:
        value = _size_bytes(text, "the size")
    except CliError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value % MiB:
        raise argparse.ArgumentTypeError(f"a device size is a whole number of MiB, got {text!r}")
    return value // MiB


def run_worker(subcommand: str, args: list[str], limit_mb: int, timeout: float | None = None,
               env: Mapping[str, str] | None = None) -> dict:
    """Runs `python -m capuchin_tf <subcommand> ...` (a hidden worker) in a fresh process on a simulated device of
    `limit_mb` MiB; returns its JSON result.

    The worker's standard output (its progress lines) goes to this process's as it comes; `env`: variables set in its
    environment beside the simulated device's. Raises CliError when the process leaves no result (it died, or ran
    longer than `timeout` seconds and was killed).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "capuchin_tf", subcommand, *args, "--result", str(out)]
        sys.stdout.flush()
        try:
            proc = subprocess.run(cmd, env={**simulated_device_env(limit_mb), **(env or {})}, stderr=subprocess.PIPE,
                                  text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as e:
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            raise CliError(f"the worker process was killed after the {timeout:g} s timeout:\n{stderr[-4000:]}\n"
                           f"timed out after {timeout:g} s") from None
        if not out.exists():
            raise CliError(f"the worker process failed (exit code {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def steal_s() -> float | None:
    """Seconds every CPU of this machine has been stolen since boot (the `steal` column of /proc/stat: time a virtual
    CPU was ready while the hypervisor ran something else); None where the kernel does not say. On the shared
    machines the benchmarks run on, a step that loses a core to another tenant is slower for a reason outside the
    process (docs/decisions.md, "Timed runs record what the hypervisor took")."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else None
    except (OSError, ValueError, IndexError):
        return None


def machine() -> dict:
    """The machine a result was measured on (every result JSON carries it)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        memory = None
    return {"node": platform.node(), "cores": os.cpu_count(), "memory_bytes": memory,
            "platform": platform.platform(), "python": platform.python_version()}


def git_commit(repo: str | pathlib.Path | None = None) -> str:
    """`git rev-parse HEAD`, with "-dirty" when tracked files changed; "unknown" outside a git work tree."""
    cwd = pathlib.Path(repo or pathlib.Path(__file__).resolve().parents[2])
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")




def stamp() -> dict:
    """What every result JSON starts with: the commit, the date and the machine."""
    return {"commit": git_commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine()}
