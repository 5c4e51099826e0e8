"""The checks before any model loads: the config alone (`validate`), then the data, rewards,
tokenizers and model directories it names (`preflight`); each fails with one line naming the
key, file or row.
"""
