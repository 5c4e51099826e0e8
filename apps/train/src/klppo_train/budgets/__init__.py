"""Token budgets: the budgets in force and the OOM back-off (`run_budgets`), the
`KLPPO_FAULT_OOM` test hook (`faults`). The role table is `klppo_train.config.roles`; `auto`
budgets are measured before step 0 by `klppo_train.trainer.probe`.
"""
