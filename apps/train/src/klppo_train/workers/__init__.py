"""A model's work over a batch of trajectories: the samples' layout (`trajectories`), the
forward functions (`forward`), the budgeted forward passes (`passes`) and the trained model
with its optimizer and update (`trainee`). PPO's actor, critic and reference and the reward
model are all built from these.
"""
