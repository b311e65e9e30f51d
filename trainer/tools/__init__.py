"""Tools around training: throughput benchmark, the model.fit baseline, a
localhost multi-worker launcher."""
