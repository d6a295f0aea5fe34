"""Micro-benchmark of the picker's pick + release, the per-request part of replica choice.

    .venv/bin/python bench/pick_bench.py [--replicas 4,64] [--rounds 200000]

One model with N ready replicas, `rounds` pick/release pairs on one thread,
with a few requests held so loads differ. Variants: plain (the default
least-loaded pick), with engine load known on every replica (waiting requests
and KV cache usage, some near full), and with a prefix-affinity key per
request. Prints nanoseconds per pick + release.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec  # noqa: E402

from hub.contracts import EndpointTable  # noqa: E402
from router.accounting.ledger import Ledger  # noqa: E402
from router.endpoints.routes import RouteTable  # noqa: E402
from router.picking.picker import Picker  # noqa: E402

MODEL = "bench-model"


def picker_with(replicas: int) -> Picker:
    routes = RouteTable()
    picker = Picker(routes, Ledger(routes))
    endpoints = [
        {"replica_id": str(i), "model": MODEL, "url": f"http://127.0.0.1:{20000 + i}", "pool": "default"}
        for i in range(replicas)
    ]
    picker.routes.apply_table(msgspec.convert({"models": {MODEL: {}}, "endpoints": endpoints}, EndpointTable))
    return picker


def run(picker: Picker, rounds: int, **kwargs) -> float:
    keys = kwargs.pop("affinity_keys", None)
    held = [picker.pick(MODEL, **kwargs) for _ in range(3)]  # uneven loads, as under traffic
    pick, release = picker.pick, picker.release
    started = time.perf_counter_ns()
    if keys is None:
        for _ in range(rounds):
            release(pick(MODEL, **kwargs))  # type: ignore[arg-type]
    else:
        n = len(keys)
        for i in range(rounds):
            release(pick(MODEL, affinity=keys[i % n], **kwargs))  # type: ignore[arg-type]
    elapsed = time.perf_counter_ns() - started
    for endpoint in held:
        picker.release(endpoint)  # type: ignore[arg-type]
    return elapsed / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="4,64")
    parser.add_argument("--rounds", type=int, default=200_000)
    args = parser.parse_args()
    has_affinity = "affinity" in inspect.signature(Picker.pick).parameters
    print("| replicas | variant | ns per pick + release |")
    print("|---:|---|---:|")
    for n in (int(x) for x in args.replicas.split(",")):
        picker = picker_with(n)
        print(f"| {n} | plain | {run(picker, args.rounds):.0f} |")
        if not has_affinity:
            continue
        for i, endpoint in enumerate(picker.routes.endpoints(MODEL)):
            picker.record_engine_load(endpoint, i % 3, 0.99 if i % 4 == 0 else 0.5)
        print(f"| {n} | engine load known | {run(picker, args.rounds):.0f} |")
        keys = [hash(f"prefix {i}") for i in range(64)]
        print(f"| {n} | engine load + affinity | {run(picker, args.rounds, affinity_keys=keys):.0f} |")


if __name__ == "__main__":
    main()
