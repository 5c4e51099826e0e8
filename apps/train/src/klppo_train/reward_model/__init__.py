"""The learned reward model: preference pairs, its training (``trainer.task=reward_model``),
its HF directory, and the worker that scores responses in the PPO step."""
