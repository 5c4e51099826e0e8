"""What the run runs on: the process group and metric reduction (`process_group`), what the
launcher set up and deferred imports (`launch`), precision, the packed attention, Ulysses
sequence parallelism, LoRA, the allocator, the rollout engine and sampling (`engine`), HF
directories (`hf_dirs`).
"""
