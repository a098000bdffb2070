"""What a live bus connection per experiment costs the operator: its BusReader (kuberl.operator.progress) holding N NATS
connections, each with its KV handle, and reading progress over each.

Run: `python bench/bench_operator_bus_connections.py --n 300`. With embedded buses (the default deployment) every
running experiment has a bus of its own, so the operator holds a connection per experiment; the scale bench
(bench_operator_scale.py) cannot show it, since KWOK's pods run no NATS there. Here one real nats-server without auth
stands in for the N buses: the reader keeps a connection per (URL, credentials), so a distinct token per experiment
gives a connection per experiment, as distinct buses would. Printed: the connections held, this process's RSS before
and after they opened (per connection), and the CPU of `--rounds` progress reads over all of them (per read).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def rss() -> int:
    line = next(x for x in Path(f"/proc/{os.getpid()}/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) * 1024


async def run(n: int, rounds: int) -> None:
    import nats

    from kuberl.operator.progress import BusReader, kv_bucket
    from kuberl.runtime.bus.server import start_nats_server

    store = tempfile.mkdtemp(prefix="kuberl-bench-conns-")
    server = start_nats_server(store_dir=store)
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        for i in range(n):
            kv = await js.create_key_value(bucket=kv_bucket(f"s{i:04d}", "run"))
            await kv.put("progress", json.dumps({"step": 1, "total_steps": 100}).encode())
        await nc.close()
        reader = BusReader()
        assert await reader.read(server.url, "warm-up", "s0000", run="run")  # the imports and a first connection
        before = rss()
        for i in range(n):  # a connection per experiment, as with a bus each
            assert await reader.read(server.url, f"token-{i}", f"s{i:04d}", run="run")
        after = rss()
        cpu0 = time.process_time()
        for _ in range(rounds):
            for i in range(n):
                assert await reader.read(server.url, f"token-{i}", f"s{i:04d}", run="run")
        cpu = time.process_time() - cpu0
        print(f"{reader.open_connections()} live connections (BusReader.connects {reader.connects}); RSS {before / 2**20:.1f} -> "
              f"{after / 2**20:.1f} MiB: {(after - before) / n / 1024:.0f} KiB per connection; {rounds * n} progress reads in "
              f"{cpu:.2f} CPU-s: {1000 * cpu / (rounds * n):.2f} ms per read")
        await reader.close()
    finally:
        server.stop()
        shutil.rmtree(store, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300, help="connections, one per experiment (default 300)")
    ap.add_argument("--rounds", type=int, default=5, help="progress reads per connection measured (default 5)")
    args = ap.parse_args(argv)
    asyncio.run(run(args.n, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
