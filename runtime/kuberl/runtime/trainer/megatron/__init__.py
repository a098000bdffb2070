"""The Megatron backend's model core (issue #13): megatron-core GPTModel with tensor, pipeline and expert parallelism.

`convert`: Hugging Face <-> megatron-core configs and weights (Qwen2, Qwen3, Llama, Qwen3-MoE), pure functions;
`convert_moe` the MoE layers' router and experts and their expert-parallel split.
`model`: build this rank's GPTModel from a HF model directory, response log-probs, the decoupled PPO train step
through megatron's pipeline schedules, weight gathering back to HF names; `rows` (micro-batch inputs, padded for
pipeline and expert parallelism, and log-probs from vocab-parallel logits) and `grads` (gradient sums over the
data- and expert-data-parallel groups, the grad norm) are its parts.
`cpu`: what megatron-core needs to run on the CPU with gloo (the dev/test path only), and without Transformer Engine.
`backend`: the Trainer's megatron path (trainer.backend megatron): set-up, pi_prox, update, publishing, checkpoints;
`consolidate` reads such a checkpoint back as one HF state dict (checkpoint.read_model_state).

megatron-core is imported lazily (inside functions), so `convert`, `convert_moe` and `consolidate` load without it.
"""
