"""The one run loop every task runs under (`run_loop`), its checkpoints (`checkpoints`),
preemption (`preemption`), the end-of-run report (`report`) and the run directory
(`run_dir`).
"""
