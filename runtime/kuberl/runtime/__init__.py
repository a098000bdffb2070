"""kuberl.runtime: the roles that run inside the pods (bus, engines, rollout agent, trainer) and the
local launcher behind `kuberl run`. Never imports kuberl.operator."""
