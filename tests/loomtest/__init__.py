"""Shared test helpers, imported as `loomtest.<module>` (pytest puts tests/ on the path).

- `plancheck`: the planner's coverage, capacity and mixture checks, shared by unit and integration tests;
- `stream`: a real indexed corpus, its plan, and an independent oracle read for streaming tests.
"""
