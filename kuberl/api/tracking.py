"""`spec.tracking`: experiment tracking (TensorBoard, Weights & Biases, MLflow) of every training step.

Each block present selects a tracker; nothing selected means nothing is written besides the run's
`metrics.jsonl`. Trackers run on trainer rank 0 only (kuberl.runtime.tracking). Credentials are named
by Secret (`apiKeySecret`, `tokenSecret`): the operator hands them to the trainer container as
environment variables through `secretKeyRef` (the variable names below, the ones the libraries read
themselves), so their values never land in the manifest, a ConfigMap, a log or the status.
`kuberl run` has no Secrets: it passes your shell's WANDB_API_KEY / MLFLOW_TRACKING_TOKEN on.

Built on the pieces of kuberl.api.v1alpha1 (which imports this module for RLExperimentSpec.tracking).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from kuberl.api.base import KubeModel, SecretKeyRef, _cel

# The environment variables the trainer reads the credentials from (the libraries' own names).
WANDB_API_KEY_ENV = "WANDB_API_KEY"
MLFLOW_TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"

TRACKING_EMPTY = "tracking needs at least one of tracking.tensorboard, tracking.wandb or tracking.mlflow"
WANDB_ONLINE_NEEDS_KEY = "tracking.wandb.mode online needs tracking.wandb.apiKeySecret (or mode offline)"
WANDB_OFFLINE_KEY = "tracking.wandb.apiKeySecret and tracking.wandb.host have no effect with tracking.wandb.mode offline"
MLFLOW_TOKEN_NEEDS_SERVER = "tracking.mlflow.tokenSecret needs an http(s):// tracking.mlflow.trackingUri"

# A folder inside the workdir: relative, no `..` segment, no leading slash (RE2: no look-ahead).
RELATIVE_PATH = r"^[A-Za-z0-9_][-A-Za-z0-9_.]*(/[A-Za-z0-9_][-A-Za-z0-9_.]*)*$"
# [^\t\n\f\r ] is RE2's \S spelled out: pydantic's (Rust) \S is Unicode, so \S let the two disagree on a no-break space.
_HTTP = r"^https?://[^\t\n\f\r ]+$"


class TensorBoardSpec(KubeModel):
    """TensorBoard event files (torch.utils.tensorboard), one scalar per metric and step."""

    log_dir: str = Field(
        "tensorboard", max_length=253, pattern=RELATIVE_PATH,
        description="Folder inside the run's workdir (the checkpoint volume in a cluster, ./runs/<name> for kuberl run) for the event files.",
    )


class WandbMode(StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"


class WandbSpec(KubeModel):
    """Weights & Biases. offline writes the run under <workdir>/wandb for a later `wandb sync`, with no network."""

    model_config = _cel(
        ("self.mode == 'offline' || has(self.apiKeySecret)", WANDB_ONLINE_NEEDS_KEY, ".apiKeySecret"),
        ("self.mode == 'online' || (!has(self.apiKeySecret) && !has(self.host))", WANDB_OFFLINE_KEY, ".mode"),
    )
    project: str = Field(min_length=1, max_length=128, pattern=r"^[^/\\#?%:]+$", description="W&B project.")
    entity: str | None = Field(None, min_length=1, max_length=128, description="W&B entity (user or team); default: the key's own.")
    mode: WandbMode = Field(WandbMode.ONLINE, description="online: stream to the W&B server; offline: files only (no network).")
    run_name: str | None = Field(None, min_length=1, max_length=128, description="Run name; default: the experiment's name.")
    group: str | None = Field(None, min_length=1, max_length=128, description="W&B run group.")
    tags: list[str] = Field(default_factory=list, max_length=32, description="W&B run tags.")
    host: str | None = Field(None, pattern=_HTTP, max_length=2048, description="A self-hosted W&B server (WANDB_BASE_URL); default: api.wandb.ai.")
    api_key_secret: SecretKeyRef | None = Field(None, description=f"Secret with the W&B API key (given to the trainer as {WANDB_API_KEY_ENV}).")

    @model_validator(mode="after")
    def _rules(self) -> WandbSpec:
        if self.mode == WandbMode.ONLINE and self.api_key_secret is None:
            raise ValueError(WANDB_ONLINE_NEEDS_KEY)
        if self.mode == WandbMode.OFFLINE and (self.api_key_secret is not None or self.host is not None):
            raise ValueError(WANDB_OFFLINE_KEY)
        return self


class MlflowSpec(KubeModel):
    """MLflow: a tracking server (http(s)://) or a file store; default a file store `mlruns` in the workdir."""

    model_config = _cel(
        ("!has(self.tokenSecret) || (has(self.trackingUri) && self.trackingUri.matches('^https?://'))", MLFLOW_TOKEN_NEEDS_SERVER, ".tokenSecret"),
    )
    tracking_uri: str | None = Field(
        None, max_length=2048, pattern=r"^(https?://|file:)[^\t\n\f\r ]+$",
        description="http(s)://server:5000, or file:///abs/path (a folder the trainer can write); default: file store <workdir>/mlruns.",
    )
    experiment_name: str | None = Field(None, min_length=1, max_length=256, description="MLflow experiment; default: the experiment's namespace/name.")
    run_name: str | None = Field(None, min_length=1, max_length=256, description="Run name; default: the experiment's name.")
    token_secret: SecretKeyRef | None = Field(
        None, description=f"Secret with a bearer token for the tracking server (given to the trainer as {MLFLOW_TOKEN_ENV}).")

    @model_validator(mode="after")
    def _rules(self) -> MlflowSpec:
        if self.token_secret is not None and not (self.tracking_uri or "").startswith(("http://", "https://")):
            raise ValueError(MLFLOW_TOKEN_NEEDS_SERVER)
        return self


class TrackingSpec(KubeModel):
    """Experiment trackers the trainer (rank 0) writes every step's metrics to, besides metrics.jsonl. A tracker that
    is down never stops training: the trainer logs it once and goes on."""

    model_config = _cel(("has(self.tensorboard) || has(self.wandb) || has(self.mlflow)", TRACKING_EMPTY))
    tensorboard: TensorBoardSpec | None = Field(None, description="TensorBoard event files in the workdir.")
    wandb: WandbSpec | None = Field(None, description="Weights & Biases.")
    mlflow: MlflowSpec | None = Field(None, description="MLflow.")

    @model_validator(mode="after")
    def _any(self) -> TrackingSpec:
        if self.tensorboard is None and self.wandb is None and self.mlflow is None:
            raise ValueError(TRACKING_EMPTY)
        return self

    def secret_env(self) -> list[tuple[str, SecretKeyRef]]:
        """(environment variable, Secret key) pairs the trainer needs; the operator renders them as secretKeyRef."""
        out = []
        if self.wandb is not None and self.wandb.api_key_secret is not None:
            out.append((WANDB_API_KEY_ENV, self.wandb.api_key_secret))
        if self.mlflow is not None and self.mlflow.token_secret is not None:
            out.append((MLFLOW_TOKEN_ENV, self.mlflow.token_secret))
        return out
