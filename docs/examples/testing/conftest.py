pytest_plugins = ["trainer.testing"]  # 2 CPU devices, the step_config fixture
