"""On the path first, this makes `import poolipc` fail as it does without the wheel."""
raise ImportError("No module named 'poolipc' (the tests' stand-in for a missing wheel)")
