"""A discrete-event simulator of the whole cluster that runs the planner's own core."""
