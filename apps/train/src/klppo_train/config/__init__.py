"""The run's configuration: typed sections and their loading (`schema`), verl's names
(`verl_names`), the checks before any model loads (`validate`, `preflight`) and the user
error they raise (`errors`).
"""
