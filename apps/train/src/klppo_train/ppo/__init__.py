"""One PPO step over objects built once: the step and `train_on` (`step`), where its
trajectories come from (`rollouts`, `balance`), what it holds (`components`), its losses
(`losses`), rewards to advantages (`algorithm`), rollout correction.
"""
