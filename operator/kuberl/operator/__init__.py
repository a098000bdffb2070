"""kuberl.operator: the kopf operator that reconciles RLExperiments into cluster objects.

Never imports kuberl.runtime (import-linter checks it); talks to pods only through the objects it renders.
"""
