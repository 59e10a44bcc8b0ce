"""Goodput-driven autoscaling: a pure decision core (planner.core), a Ray adapter that applies its
decisions, and a discrete-event simulator (planner.sim) that runs the same core at any scale."""
