"""What a run shows: the metrics catalogue, the step records, Prometheus, plots, trackers, the sample log, progress lines and the driver log."""
