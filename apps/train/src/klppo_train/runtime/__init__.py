"""What the run runs on: the process group and metric reduction (`process_group`), precision,
the packed attention, the allocator, the rollout engine and sampling (`engine`), rollouts
balanced over ranks (`balance`), HF directories (`hf_dirs`).
"""
