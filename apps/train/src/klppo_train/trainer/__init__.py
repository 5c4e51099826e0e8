"""The run: every component built from the config (`build`), the loop (`run`), checkpoints,
reports, LR schedules.
"""
