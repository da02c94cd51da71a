"""Discrete-event simulation of one engine replica and the SLO capacity search."""
