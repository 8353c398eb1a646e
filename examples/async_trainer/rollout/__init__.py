"""Rollout: the engines (in-process or Ray actors), the session-affine router, placement,
the supervisor of a rollout process, multi-turn sessions and their trajectories, the data
buffer, and the weight sync from the trainer."""
