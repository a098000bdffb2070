"""KubeRL: fully asynchronous RL for LLMs on Kubernetes (kuberl.operator) or one machine (kuberl run).

kuberl.api holds the RLExperiment models every role shares; kuberl.operator and kuberl.runtime
import it and never each other. Each of the three is its own distribution: this folder (the API and
the CLI, no torch), operator/ (kopf, no torch) and runtime/ (torch, the engines). In a checkout they
are three folders named kuberl/ on sys.path (scripts/setup.sh installs them so); installed from
wheels they share one site-packages/kuberl/. Either way `kuberl` is one package (pkgutil.extend_path below).
"""

__path__ = __import__("pkgutil").extend_path(__path__, __name__)

__version__ = "0.1.0"
