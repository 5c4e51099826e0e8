"""One PPO step over objects built once: the step (`step`), what it holds (`components`), its
samples (`trajectories`), the forward passes (`passes`, `forward`), the trained models and
their losses (`trainee`, `losses`), rewards to advantages (`algorithm`).
"""
