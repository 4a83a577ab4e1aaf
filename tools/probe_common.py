"""What the probes and profiles in tools/ share: the arguments that name a training step under a budget.

Imported by the scripts beside it (run as `python tools/<script>.py`, which puts tools/ on the path)."""

from __future__ import annotations

import argparse


def step_parser(doc: str, *, model: str | None = None, batch: int | None = None, policy: str | bool | None = False,
                link: str = "p100") -> argparse.ArgumentParser:
    """A parser with the script's first docstring line as description and --model, --batch (required unless given a
    default), --budget-mb (whole MiB), --link and --json; --policy when `policy` is a default name, required when None,
    absent when False. The script adds its own arguments."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", required=model is None, default=model)
    p.add_argument("--batch", type=int, required=batch is None, default=batch)
    p.add_argument("--budget-mb", type=int, required=True)
    if policy is not False:
        p.add_argument("--policy", required=policy is None, default=policy)
    p.add_argument("--link", default=link)
    p.add_argument("--json", required=True)
    return p


def write_stamped(a, fields: dict) -> dict:
    """`fields` after the stamp every recorded result carries (commit, date, machine) and the step's arguments that
    `a` has (model, batch, budget_mb, link), written as JSON to `a.json`; returns the whole result."""
    import json
    import time

    from capuchin_tf.cli.common import git_commit, machine

    result = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine()}
    result.update({k: getattr(a, k) for k in ("model", "batch", "budget_mb", "link") if hasattr(a, k)})
    result.update(fields)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    return result
