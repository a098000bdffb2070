"""Experiment tracking: every training step's metrics to TensorBoard, Weights & Biases and/or MLflow.

`Tracking.from_spec(spec.tracking, ...)` on trainer rank 0; `log(step, row)` after each step's
metrics.jsonl line; `close()` when training ends. Each selected tracker runs in a thread of its own
with a bounded queue, so a slow or unreachable server (MLflow retries HTTP for minutes) never holds
a training step up, and a tracker that fails to start or to write is logged once (then once more
when it works again) while training goes on; its steps are kept (up to MAX_PENDING) and sent when it
comes back. Credentials come from the environment only (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN: set
by the operator from Secrets, or your shell's under `kuberl run`); nothing here logs them.

Metric names are the metrics.jsonl keys (`reward_mean`, `loss`, `entropy`, `staleness_mean`,
`samples_per_second`, ...); nested dicts become `timings/train.collect`. Non-numeric values and
NaN/inf are left out. The run ids of W&B and MLflow are kept in <workdir>/tracking.json, so a
trainer that restarts from a checkpoint goes on writing to the same run.

Prometheus (kuberl.runtime.prom) is not one of spec.tracking's trackers: whenever $KUBERL_METRICS_PORT
is set (the trainer Job sets it), `from_spec` starts its HTTP server, with or without spec.tracking,
and `log` sets its gauges in the caller's thread (cheap, no I/O).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from kuberl.api.tracking import TrackingSpec
from kuberl.runtime.prom import TrainerMetrics, metrics_port, serve_trainer_metrics

log = logging.getLogger("kuberl.tracking")

MAX_PENDING = 100_000  # steps a tracker keeps while it is down (oldest dropped first)
RETRY_SECONDS = 60.0  # a tracker that failed is retried at most this often
CLOSE_RETRIES = 3  # at the end of training, steps still waiting get this many more tries ...
CLOSE_RETRY_SECONDS = 2.0  # ... this far apart (within Tracking.close's timeout)
IDS_FILE = "tracking.json"
_SKIP = frozenset({"step", "time"})
_NAME_BAD = re.compile(r"[^\w.\-/ :]")  # MLflow's allowed metric-name characters; the others become "_"


def flatten_metrics(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric, finite values of a metrics.jsonl row, nested dicts joined with '/'."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if not prefix and key in _SKIP:
            continue
        name = _NAME_BAD.sub("_", f"{prefix}{key}")
        if isinstance(value, dict):
            out.update(flatten_metrics(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


class RunIds:
    """Run ids kept in <workdir>/tracking.json so a restarted trainer continues the same W&B / MLflow run."""

    def __init__(self, workdir: Path) -> None:
        self.path = workdir / IDS_FILE
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._read().get(key)

    def put(self, key: str, value: str) -> None:
        with self._lock:
            ids = self._read()
            ids[key] = value
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(ids, indent=1))
            tmp.replace(self.path)

    def _read(self) -> dict[str, str]:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}


# ----------------------------------------------------------------------------------------------
# Backends: start() may raise (the worker logs and retries); log() writes one step; close() flushes.
# ----------------------------------------------------------------------------------------------


class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.writer: Any = None

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # A trainer restarted from a checkpoint re-trains the steps after it, and a new event file of the same run
            # would show those steps twice: purge_step hides the earlier files' events from this step on.
            resumed = any(self.log_dir.glob("events.out.tfevents.*"))
            self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=step if resumed else None)
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step, walltime=wall_time)
        self.writer.flush()  # a killed trainer keeps every step it reported

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbBackend:
    name = "wandb"
    STEP_KEY = "trainer/step"

    def __init__(self, spec: Any, *, workdir: Path, run_name: str, config: dict[str, Any], ids: RunIds) -> None:
        self.spec, self.workdir, self.run_name, self.config, self.ids = spec, workdir, run_name, config, ids
        self.run: Any = None

    def start(self) -> None:
        import wandb

        if self.spec.host:
            os.environ.setdefault("WANDB_BASE_URL", self.spec.host)
        run_id = self.ids.get("wandb") or uuid.uuid4().hex[:12]  # W&B ids: [a-z0-9]
        self.ids.put("wandb", run_id)
        self.run = wandb.init(
            project=self.spec.project, entity=self.spec.entity, mode=self.spec.mode, dir=str(self.workdir), id=run_id, resume="allow",
            name=self.spec.run_name or self.run_name, group=self.spec.group, tags=list(self.spec.tags) or None, config=self.config,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        # Steps may repeat after a restart from a checkpoint: W&B's own step must only grow, so the
        # training step is a metric of its own that every other metric is plotted against.
        self.run.define_metric(self.STEP_KEY)
        self.run.define_metric("*", step_metric=self.STEP_KEY)

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        self.run.log({self.STEP_KEY: step, **metrics})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class MlflowBackend:
    name = "mlflow"

    def __init__(self, spec: Any, *, workdir: Path, run_name: str, experiment: str, params: dict[str, Any], ids: RunIds) -> None:
        self.spec, self.run_name, self.experiment, self.params, self.ids = spec, run_name, experiment, params, ids
        self.uri = spec.tracking_uri or (workdir / "mlruns").resolve().as_uri()
        self.client: Any = None
        self.run_id: str | None = None

    def start(self) -> None:
        if self.uri.startswith("file:"):
            # MLflow 3 keeps its file store in "maintenance mode" behind this switch; it is what needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        else:  # fail fast while the server is down (the worker retries): not MLflow's minutes of backoff
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunStatus

        client = MlflowClient(tracking_uri=self.uri)
        run_id = self.ids.get("mlflow:" + self.uri)
        if run_id is not None:
            client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            exp = client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
            run_id = client.create_run(exp_id, run_name=self.spec.run_name or self.run_name,
                                       tags={"kuberl.io/experiment": self.experiment}).info.run_id
            client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in self.params.items()])
            self.ids.put("mlflow:" + self.uri, run_id)
        self.client, self.run_id = client, run_id

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        items = [Metric(k, v, ms, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)


# ----------------------------------------------------------------------------------------------
# One worker thread per backend
# ----------------------------------------------------------------------------------------------

_CLOSE = object()


class _Worker:
    def __init__(self, backend: Any, retry_seconds: float) -> None:
        self.backend = backend
        self.retry_seconds = retry_seconds
        self.inbox: queue.Queue = queue.Queue()
        self.pending: deque[tuple[int, dict[str, float], float]] = deque(maxlen=MAX_PENDING)
        self.started = False
        self.failing = False
        self.last_try = -math.inf
        self.written = 0  # steps written (for tests and the closing log line)
        self.thread = threading.Thread(target=self._loop, name=f"kuberl-tracking-{backend.name}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.inbox.get()
            closing = item is _CLOSE
            if not closing:
                if len(self.pending) == self.pending.maxlen:
                    log.warning("tracking: %s: %d steps waiting, dropping the oldest", self.backend.name, len(self.pending))
                self.pending.append(item)
            self._flush(force=closing)
            if closing:
                for _ in range(CLOSE_RETRIES):  # a tracker down at the end (e.g. W&B's service slow to start) gets a few more tries
                    if not self.pending:
                        break
                    time.sleep(CLOSE_RETRY_SECONDS)
                    self._flush(force=True)
                self._close()
                return

    def _flush(self, force: bool) -> None:
        if not self.pending:
            return
        now = time.monotonic()
        if self.failing and not force and now - self.last_try < self.retry_seconds:
            return
        self.last_try = now
        try:
            if not self.started:
                self.backend.start()
                self.started = True
            while self.pending:
                step, metrics, wall = self.pending[0]
                self.backend.log(step, metrics, wall)
                self.pending.popleft()
                self.written += 1
        except Exception as exc:  # any failure of a tracker: never the trainer's
            if not self.failing:
                log.warning("tracking: %s failed (%s: %s); training goes on, its steps are kept and retried every %.0f s",
                            self.backend.name, type(exc).__name__, exc, self.retry_seconds)
            self.failing = True
            return
        if self.failing:
            log.info("tracking: %s works again", self.backend.name)
            self.failing = False

    def _close(self) -> None:
        if self.pending:
            log.warning("tracking: %s: %d steps were not written", self.backend.name, len(self.pending))
        if self.started:
            try:
                self.backend.close()
            except Exception as exc:
                log.warning("tracking: closing %s failed (%s: %s)", self.backend.name, type(exc).__name__, exc)


class Tracking:
    """The selected trackers of one run (trainer rank 0). `log` never blocks; `close` waits up to `timeout`."""

    def __init__(self, backends: list[Any], retry_seconds: float = RETRY_SECONDS, prometheus: TrainerMetrics | None = None,
                 prometheus_server: Any = None) -> None:
        self.workers = [_Worker(b, retry_seconds) for b in backends]
        self.prometheus = prometheus  # the /metrics gauges (set in log), served by prometheus_server
        self.prometheus_server = prometheus_server

    @classmethod
    def from_spec(cls, spec: TrackingSpec | None, *, workdir: str | Path, name: str, namespace: str,
                  config: dict[str, Any] | None = None, retry_seconds: float = RETRY_SECONDS) -> Tracking:
        """The trackers `spec` selects (none for None); `config` is the manifest's spec, recorded with the run."""
        workdir = Path(workdir)
        backends: list[Any] = []
        if spec is not None:
            ids = RunIds(workdir)
            config = config or {}
            if spec.tensorboard is not None:
                backends.append(TensorBoardBackend(workdir / spec.tensorboard.log_dir))
            if spec.wandb is not None:
                backends.append(WandbBackend(spec.wandb, workdir=workdir, run_name=name, config=config, ids=ids))
            if spec.mlflow is not None:
                backends.append(MlflowBackend(spec.mlflow, workdir=workdir, run_name=name, ids=ids,
                                              experiment=spec.mlflow.experiment_name or f"{namespace}/{name}", params=run_params(config)))
        if backends:
            log.info("tracking: %s", ", ".join(b.name for b in backends))
        prometheus = server = None
        port = metrics_port()  # a bad value is a configuration error: raised, not ignored
        if port is not None:
            prometheus = TrainerMetrics()
            server = serve_trainer_metrics(prometheus, port)
        return cls(backends, retry_seconds, prometheus=prometheus, prometheus_server=server)

    def log(self, step: int, row: dict[str, Any]) -> None:
        metrics = flatten_metrics(row)
        wall = row.get("time") or time.time()
        if self.prometheus is not None:
            try:
                self.prometheus.observe(step, row)
            except Exception as exc:  # never the trainer's failure
                log.warning("tracking: prometheus metrics not set for step %d (%s: %s)", step, type(exc).__name__, exc)
        for w in self.workers:
            w.inbox.put((step, metrics, wall))

    def close(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.inbox.put(_CLOSE)
        for w in self.workers:
            w.thread.join(max(0.0, deadline - time.monotonic()))
            if w.thread.is_alive():
                log.warning("tracking: %s did not finish within %.0f s; leaving it", w.backend.name, timeout)
        if self.prometheus_server is not None:
            self.prometheus_server.shutdown()
            self.prometheus_server.server_close()
            self.prometheus_server = None


def run_params(spec: dict[str, Any]) -> dict[str, Any]:
    """The few settings worth a column in MLflow (the whole spec goes to W&B's config)."""
    algo = spec.get("algorithm") or {}
    model = spec.get("model") or {}
    return {k: v for k, v in {
        "model": model.get("id") or model.get("path") or model.get("builtin"),
        "dataset": (spec.get("dataset") or {}).get("id") or (spec.get("dataset") or {}).get("path") or (spec.get("dataset") or {}).get("builtin"),
        "algorithm": algo.get("name"), "batch_size": algo.get("batchSize"), "samples_per_prompt": algo.get("samplesPerPrompt"),
        "learning_rate": algo.get("learningRate"),
        "max_head_offpolicyness": (spec.get("staleness") or {}).get("maxHeadOffpolicyness"), "seed": spec.get("seed"),
    }.items() if v is not None}
