"""Observability: FLOPs and MFU, the step meter, the metrics file and log line, trackers, profiling,
evaluation during training, the run summary and plots."""
