"""Experiment trackers (``trainer.logger``): the backends rank 0's metrics and validation
generations go to (`trackers`), chosen and checked without importing them (`backends`)."""
