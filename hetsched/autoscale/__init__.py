"""Autoscaler: live demand → replicas on the cheapest accelerators, without flapping.

Pure functions hold every decision: one round is
:func:`hetsched.autoscale.step.scale_step` (windows, then
:func:`hetsched.autoscale.policy.decide`, then a re-solve when due); the
operator's reconcile pass and ``hetsched autoscale``'s loop only gather
signals and apply the result.
"""
