"""Placement optimizer: build a typed problem, solve the MILP with HiGHS, pack onto nodes, render."""
