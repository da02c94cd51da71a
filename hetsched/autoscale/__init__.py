"""Autoscaler: live demand → replicas on the cheapest accelerators, without flapping.

Pure functions hold every decision (:func:`hetsched.autoscale.policy.decide`);
the operator and ``hetsched autoscale`` only gather signals and apply the result.
"""
