"""Agents shipped with the runtime image, for `workflow.type: agent` (`workflow.agent: kuberl.runtime.agents.<module>:<function>`).

Each is an ordinary OpenAI-client agent: it takes (client, item), talks to the model only through the
client, and returns a reward or None. `repeat` is the tiny-model demonstration; `tir` is math with a
sandboxed Python tool (tool-integrated reasoning).
"""
