"""Rollout: workflows (one data set item -> a trajectory group) and the agent that runs them from bus tickets.

`kuberl rollout` (main.py) runs one RolloutAgent next to one inference engine.
"""
