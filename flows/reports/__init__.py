"""What compass shows a person, computed from a plan, the store or a run: the plan's tables, would-it-run status,
the mixture's epochs, the smoke table, a run's outcome and progress lines, recent runs on the server. Reports read;
they never run or write a step."""
