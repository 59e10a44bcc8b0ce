"""The planner's pure decision core: typed observations in, typed replica targets out."""
