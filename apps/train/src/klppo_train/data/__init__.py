"""Prompts, preference pairs and rewards: verl-format parquet, chat templates, the resumable
loader (`datasets`); preference rows (`pairs`); rule rewards and custom reward functions
(`rewards`); registered data and model sources (`sources`).
"""
