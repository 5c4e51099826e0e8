"""The tasks and how they are built: the config read once into objects (`assemble`, `build`),
PPO (`run`), reward-model training (`reward_model_run`), validation and `val_only`
(`validation`, `evaluate`), `auto` token budgets measured before step 0 (`probe`,
`measure`), LR schedules. They run under `klppo_train.loop`.
"""
