"""Token budgets: the role table (`roles`), the budgets in force and the OOM back-off
(`run_budgets`), `auto` measured before step 0 (`probe`, `measure`), the `KLPPO_FAULT_OOM`
test hook (`faults`).
"""
