"""Datasets in, batched tf.data pipelines out. Never imports trainer/ or models/."""
