"""The training framework: config, devices, the step, the loop."""
