"""Multi-turn rollouts in the app: verl's tool-config file (`tool_config`) and the sampler a
run draws its samples through, single-turn or with tools (`samplers`).
"""
