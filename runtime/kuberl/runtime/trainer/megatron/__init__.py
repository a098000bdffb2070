"""The Megatron backend's model core (issue #13): megatron-core GPTModel with tensor and pipeline parallelism.

`convert`: Hugging Face <-> megatron-core configs and weights (Qwen2, Qwen3, Llama), pure functions.
`model`: build this rank's GPTModel from a HF model directory, response log-probs from vocab-parallel logits,
the decoupled PPO train step through megatron's pipeline schedules, weight gathering back to HF names.
`cpu`: what megatron-core needs to run on the CPU with gloo (the dev/test path only).
`backend`: the Trainer's megatron path (trainer.backend megatron): set-up, pi_prox, update, publishing, checkpoints.

megatron-core is imported lazily (inside the functions of `model` and `cpu`), so `convert` loads without it.
"""
