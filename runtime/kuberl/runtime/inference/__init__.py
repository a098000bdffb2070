"""Inference engines behind one narrow interface (base.InferenceEngine): vLLM and SGLang over HTTP (http_engine).

The rollout agent uses them through `engine_class(spec.rollout.engine)`; `kuberl engine` (main.py)
starts the server itself. Submodules import lazily: the SGLang client never loads vLLM.
"""
