"""Prompts and rewards: verl-format parquet, chat templates, the resumable loader (`datasets`);
rule rewards and custom reward functions (`rewards`).
"""
