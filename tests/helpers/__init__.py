"""What the tests share besides fixtures (tests/conftest.py): the model catalogue, the console-script runner, CPU
strategy subclasses, rollout callbacks, scripted tool-call turns (``scripted_turns``), and the repository's paths."""
