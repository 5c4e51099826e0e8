"""The run's configuration, torch-free, at the bottom of the app: typed sections and their
loading (`schema`, `data`), verl's names (`verl_names`), the role table of budgets and passes
(`roles`), choice lists (`choices`), `--explain` (`explain`) and the user error (`errors`).
The checks are `klppo_train.checks`.
"""
