"""What a run leaves for people to read: log lines, the live bar, metrics.json,
TensorBoard events and pictures. Only the chief writes."""
