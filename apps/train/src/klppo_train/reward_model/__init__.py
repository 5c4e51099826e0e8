"""Reward models: the pairwise training pass and accuracy (`training`), scoring in the PPO
step (`serve`), the HF export (`export`, `hf_dir`). Their run is
`klppo_train.trainer.reward_model_run`.
"""
