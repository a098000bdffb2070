"""The RLExperiment API models (pydantic), shared by the CLI, the operator and the runtime.

Imports neither kopf nor torch, so any role (and `kuberl validate`) can load it cheaply.
"""

from kuberl.api.loading import load_experiment, load_experiments
from kuberl.api.v1alpha1 import *  # noqa: F403
from kuberl.api.v1alpha1 import RLExperiment, RLExperimentSpec, RLExperimentStatus

__all__ = ["RLExperiment", "RLExperimentSpec", "RLExperimentStatus", "load_experiment", "load_experiments"]
