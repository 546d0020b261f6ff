"""What the tests share besides fixtures (tests/conftest.py): the model catalogue, the console-script runner, CPU
strategy subclasses, rollout callbacks, and the repository's paths."""
