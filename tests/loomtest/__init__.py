"""Shared test helpers, imported as `loomtest.<module>` (pytest puts tests/ on the path).

- `plancheck`: the planner's coverage, capacity and mixture checks, shared by unit and integration tests;
- `golden_plans`: reference plans on synthetic index tables and their content hashes (golden_plans.json);
- `balance_oracle`: the per-step balancer the block balancer must match byte for byte;
- `stream`: a real indexed corpus, its plan, and an independent oracle read for streaming tests.
"""
