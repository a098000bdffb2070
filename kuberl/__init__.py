"""KubeRL: fully asynchronous RL for LLMs on Kubernetes (kuberl.operator) or one machine (kuberl run).

kuberl.api holds the RLExperiment models every role shares; kuberl.operator and kuberl.runtime
import it and never each other.
"""

__version__ = "0.1.0"
