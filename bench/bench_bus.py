"""Throughput of the trajectory bus on this machine: tickets, trajectory groups (plain and chunked), weights.

Run: `python bench/bench_bus.py [--quick]`. Starts its own nats-server (temp store) and prints one line
per figure. Not a test: numbers depend on the machine; the tests check behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path

from kuberl.runtime.bus import Bus, Sample, Ticket, TrajectoryGroup, start_nats_server
from kuberl.runtime.bus.messages import encode


def make_group(i: int, samples: int, prompt: int, output: int, rng: random.Random) -> TrajectoryGroup:
    t = Ticket(ticket_id=f"e0-i{i}-{i}", index=i, epoch=0, issued_version=0)
    prompt_ids = [rng.randrange(150_000) for _ in range(prompt)]
    ss = [
        Sample(input_ids=prompt_ids, output_ids=[rng.randrange(150_000) for _ in range(output)],
               logprobs=[-rng.expovariate(1.0) for _ in range(output)], versions=[0] * output,
               loss_mask=[1] * output, reward=float(rng.random() > 0.5))
        for _ in range(samples)
    ]
    return TrajectoryGroup(group_id=t.ticket_id, ticket=t, samples=ss, agent="bench")


def line(what: str, n: int, seconds: float, nbytes: int | None = None) -> None:
    rate = f"{n / seconds:10.0f} /s"
    mb = f"  {nbytes / seconds / 1e6:8.1f} MB/s" if nbytes else ""
    print(f"{what:<52} {n:>6} in {seconds:6.2f}s  {rate}{mb}", flush=True)


async def bench(url: str, quick: bool) -> None:
    rng = random.Random(0)
    n_tickets = 2000 if quick else 20000
    bus = await Bus.connect(url, "bench")
    async with bus:
        tickets = [Ticket(ticket_id=f"e0-i{i}-{i}", index=i, epoch=0, issued_version=0) for i in range(n_tickets)]
        t0 = time.perf_counter()
        await bus.publish_tickets(tickets)
        line("tickets: publish (batches of 256)", n_tickets, time.perf_counter() - t0)
        t0, got = time.perf_counter(), 0
        while got < n_tickets:
            leases = await bus.pull_tickets(64, timeout=2)
            await asyncio.gather(*(lease.ack() for lease in leases))
            got += len(leases)
        line("tickets: pull 64 + ack each", got, time.perf_counter() - t0)

        for first, (label, count, samples, prompt, output) in enumerate((
            ("groups 16 x (200+1024) tokens", 20 if quick else 100, 16, 200, 1024),
            ("groups 64 x (1024+16384) tokens (chunked)", 2 if quick else 6, 64, 1024, 16384),
        )):
            # Distinct ids per round: the stream deduplicates group ids.
            groups = [make_group(first * 1000 + i, samples, prompt, output, rng) for i in range(count)]
            t0 = time.perf_counter()
            sizes = [len(encode(g)) for g in groups]
            enc = time.perf_counter() - t0
            print(f"{label}: {sum(sizes) / len(sizes) / 1e6:.2f} MB encoded each "
                  f"(chunk size {bus.chunk_size / 1e6:.1f} MB), encode {enc / count * 1e3:.0f} ms each", flush=True)
            t0 = time.perf_counter()
            for g in groups:
                assert await bus.publish_group(g), f"group {g.group_id} was a duplicate"
            line("  publish (encode included)", count, time.perf_counter() - t0, sum(sizes))
            t0, got = time.perf_counter(), 0
            while got < count:
                leases = await bus.pull_groups(count - got, timeout=30)
                if not leases:
                    raise SystemExit(f"only {got} of {count} groups came back within 30 s")
                for lease in leases:
                    await lease.ack()
                got += len(leases)
            line("  pull + decode + ack", got, time.perf_counter() - t0, sum(sizes))

        size = (20 if quick else 200) * 1024 * 1024
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "src")
            os.makedirs(src)
            await asyncio.to_thread(Path(src, "model.safetensors").write_bytes, os.urandom(size))
            t0 = time.perf_counter()
            prefix = await bus.put_weights(1, src)
            line("weights: put_weights (object store)", 1, time.perf_counter() - t0, size)
            t0 = time.perf_counter()
            await bus.get_weights(prefix, os.path.join(d, "dst"))
            line("weights: get_weights", 1, time.perf_counter() - t0, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="Smaller counts (a few seconds)")
    args = parser.parse_args()
    with start_nats_server() as server:
        print(f"nats-server pid {server.pid} at {server.url}, max_payload {server.max_payload}", flush=True)
        asyncio.run(bench(server.url, args.quick))


if __name__ == "__main__":
    main()
