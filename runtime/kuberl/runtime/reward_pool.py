"""Rewards scored off the rollout agent's event loop (AReaL's AsyncRewardWrapper): worker processes, a timeout each.

The rollout workflows `await pool.score(prompt, completion, answer, where=...)`; `pool_for(fn, ...)` hands out one
pool per reward and settings in a process (training and evaluation workflows share it). A response whose reward
runs past workflow.rewardTimeoutSeconds scores 0: it is logged with its item and counted (`timeouts`, and the
agent's kuberl_agent_reward_timeouts_total), and its worker process is killed and replaced, so a stuck reward
holds neither the agent nor a worker. The clock starts when a worker takes the response (waiting for a free
worker is not timed). A result that is not a finite number raises RewardRefused (the workflow rejects the group).
A function that cannot be sent to a process (a lambda, a closure) runs on threads: timed the same way, but a
stuck thread cannot be stopped (it is left running, and its slot is freed).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kuberl.runtime.rewards import PRELOAD, RewardError, RewardFn, RewardRefused, check_reward

log = logging.getLogger(__name__)

START_TIMEOUT_SECONDS = 120.0  # a worker's start and preload (not counted against the reward's timeout)
_TIMED_OUT = object()


@dataclass
class RewardCounts:
    """Process-wide totals over every pool (one rollout agent per process): what the agent's metrics report."""

    timeouts: int = 0  # responses whose reward ran past the timeout (scored 0)
    refused: int = 0  # results that were not finite numbers (their groups rejected)


COUNTS = RewardCounts()


def _serve(jobs: Connection, replies: Connection) -> None:
    """A worker process: load the function, say ready, then answer (prompt, completion, answer) jobs until EOF.
    Replies are ("ok", value) or ("error", text with the traceback)."""
    import importlib

    from kuberl.runtime.rollout.confine import protect_process

    # Non-dumpable first thing, as the agent is: the worker inherits the agent's environment (the bus password, the
    # engine key) and a tool run of the same user must not read it from /proc (on a kernel without Landlock, nothing else
    # stops it); exec made this interpreter dumpable again.
    protect_process()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops its workers
    payload, preload, path, parent = jobs.recv()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    sys.path[:] = path  # the parent's path: its functions import here as they do there
    try:
        for module in preload:
            importlib.import_module(module)
        fn = pickle.loads(payload)
    except BaseException as exc:  # noqa: BLE001  reported to the parent, which names the reward
        replies.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    replies.send(("ready", None))
    while True:
        try:
            args = jobs.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe or died
        try:
            reply = ("ok", fn(*args))
        except Exception as exc:  # noqa: BLE001  the user's code: reported, the worker goes on
            reply = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}")
        try:
            replies.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # a result that cannot be sent back
            replies.send(("ok", f"<unpicklable {type(reply[1]).__name__}: {exc}>"))


def _exit_with_parent(parent: int) -> None:
    """A worker whose agent died (killed, OOM) exits too, even in the middle of a stuck reward."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


async def _readable(conn: Any) -> None:
    """Wait, without a thread, until the pipe has data (or the other end closed)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class _Worker:
    """One worker process (`python -m kuberl.runtime.reward_pool JOBS_FD REPLIES_FD`) and the parent's ends of its pipes."""

    def __init__(self, process: subprocess.Popen, jobs: Connection, replies: Connection) -> None:
        self.process, self.jobs, self.conn = process, jobs, replies

    @classmethod
    def start(cls, init: tuple[Any, ...]) -> _Worker:
        """Start a fresh interpreter (nothing of the agent's state, threads or __main__ is copied) and send it `init`."""
        job_r, job_w = os.pipe()
        rep_r, rep_w = os.pipe()
        try:
            process = subprocess.Popen([sys.executable, "-m", "kuberl.runtime.reward_pool", str(job_r), str(rep_w)],
                                       pass_fds=(job_r, rep_w), stdin=subprocess.DEVNULL)
        finally:
            os.close(job_r)
            os.close(rep_w)
        worker = cls(process, Connection(job_w, readable=False), Connection(rep_r, writable=False))
        _LIVE.add(worker)
        worker.jobs.send(init)
        return worker

    async def call(self, args: tuple[str, str, str]) -> tuple[str, Any]:
        self.jobs.send(args)
        await _readable(self.conn)
        return self.conn.recv()

    def kill(self) -> None:
        """Stop the process now (a stuck reward ignores everything gentler) and close the pipes."""
        _LIVE.discard(self)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self.jobs.close()
        self.conn.close()


_LIVE: set[_Worker] = set()


@atexit.register
def _kill_live_workers() -> None:
    """Workers are plain child processes: stop them with the agent (a busy one would not notice EOF)."""
    for worker in list(_LIVE):
        worker.kill()


def _pickled(fn: RewardFn) -> bytes | None:
    """`fn` as bytes a worker process can load (by module and name), or None where it cannot be sent."""
    try:
        return pickle.dumps(fn)
    except (pickle.PicklingError, TypeError, AttributeError):
        return None


class RewardPool:
    """Scores responses with `fn` in at most `workers` processes (or threads) at once, each within `timeout_seconds`."""

    def __init__(self, fn: RewardFn, *, name: str = "reward", workers: int = 4, timeout_seconds: float = 15.0,
                 preload: tuple[str, ...] = ()) -> None:
        if workers < 1 or timeout_seconds <= 0:
            raise ValueError(f"reward pool: workers {workers} must be >= 1 and timeout {timeout_seconds} > 0")
        self.fn, self.name, self.workers, self.timeout, self.preload = fn, name, workers, timeout_seconds, preload
        self.timeouts = 0
        self.refused = 0
        self._payload = _pickled(fn)
        self._idle: list[_Worker] = []
        self._busy = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    @property
    def mode(self) -> str:
        """process (the default), or thread for a function that cannot be sent to a process."""
        return "process" if self._payload is not None else "thread"

    async def score(self, prompt: str, completion: str, answer: str, *, where: str = "a response") -> float:
        """The reward of one response; 0.0 on timeout. Raises RewardRefused (not a finite number) or RewardError (it raised)."""
        args = (prompt, completion, answer)
        await self._acquire()
        try:
            reply = await (self._in_process(args) if self._payload is not None else self._in_thread(args))
        finally:
            self._release()
        if reply is _TIMED_OUT:
            self.timeouts += 1
            COUNTS.timeouts += 1
            log.warning("workflow.reward %s: no result within %g s for %s (response %r): reward 0 (%d timeouts so far)",
                        self.name, self.timeout, where, completion[:200], self.timeouts)
            return 0.0
        status, value = reply
        if status != "ok":
            raise RewardError(f"workflow.reward {self.name} raised on {where}: {value}")
        try:
            return check_reward(value, name=self.name)
        except RewardRefused:
            self.refused += 1
            COUNTS.refused += 1
            raise

    # -- slots: at most `workers` responses in scoring; waiting for one is not timed --------------------

    async def _acquire(self) -> None:
        if self._closed:
            raise RewardError(f"workflow.reward {self.name}: the reward pool is closed")
        while self._busy >= self.workers:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken and cancelled at once: pass the free slot on
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._busy += 1

    def _release(self) -> None:
        self._busy -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    # -- processes ---------------------------------------------------------------------------------

    async def _start_worker(self) -> _Worker:
        """A new worker, once it has loaded the function (a start that fails names the reward and why)."""
        worker = _Worker.start((self._payload, self.preload, list(sys.path), os.getpid()))
        try:
            await asyncio.wait_for(_readable(worker.conn), START_TIMEOUT_SECONDS)
            status, detail = worker.conn.recv()
        except (TimeoutError, EOFError, OSError) as exc:
            worker.kill()
            raise RewardError(f"workflow.reward {self.name}: a reward worker process did not start ({type(exc).__name__})") from exc
        if status != "ready":
            worker.kill()
            raise RewardError(f"workflow.reward {self.name}: a reward worker process cannot load it: {detail}")
        return worker

    async def _in_process(self, args: tuple[str, str, str]) -> Any:
        worker = self._idle.pop() if self._idle else await self._start_worker()
        try:
            reply = await asyncio.wait_for(worker.call(args), self.timeout)
        except TimeoutError:
            worker.kill()  # stuck: a new worker takes its place on the next response
            return _TIMED_OUT
        except (EOFError, OSError) as exc:
            worker.kill()
            raise RewardError(f"workflow.reward {self.name}: its worker process died while scoring ({type(exc).__name__}: {exc}); "
                              f"exit code {worker.process.returncode}") from exc
        except BaseException:
            worker.kill()  # cancelled mid-call: its reply would reach the next response
            raise
        if self._closed:
            worker.kill()
        else:
            self._idle.append(worker)
        return reply

    # -- threads (functions that cannot be sent to a process) ---------------------------------------

    async def _in_thread(self, args: tuple[str, str, str]) -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[str, Any]] = loop.create_future()

        def deliver(reply: tuple[str, Any]) -> None:
            if not done.done():
                done.set_result(reply)

        def run() -> None:
            try:
                reply: tuple[str, Any] = ("ok", self.fn(*args))
            except Exception as exc:  # noqa: BLE001  the user's code: reported to the caller
                reply = ("error", f"{type(exc).__name__}: {exc}")
            try:
                loop.call_soon_threadsafe(deliver, reply)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for this reply any more

        # A daemon thread per response: one that never returns cannot hold the process at exit.
        threading.Thread(target=run, daemon=True, name=f"kuberl-reward-{self.name}").start()
        try:
            return await asyncio.wait_for(done, self.timeout)
        except TimeoutError:
            return _TIMED_OUT

    def close(self) -> None:
        """Stop every idle worker; busy ones stop when their response is done. Later score() calls are refused."""
        self._closed = True
        while self._idle:
            self._idle.pop().kill()


_POOLS: dict[tuple[Any, ...], RewardPool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(fn: RewardFn, *, name: str, workers: int, timeout_seconds: float) -> RewardPool:
    """The process's pool for this reward and settings (created on first use; workers start on the first response)."""
    key = (fn, name, workers, timeout_seconds)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool._closed:
            pool = _POOLS[key] = RewardPool(fn, name=name, workers=workers, timeout_seconds=timeout_seconds,
                                            preload=PRELOAD.get(name, ()))
        return pool


def close_pools() -> None:
    """Stop every pool's workers (the agent calls this on its way out)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


if __name__ == "__main__":  # a worker: python -m kuberl.runtime.reward_pool JOBS_FD REPLIES_FD
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
