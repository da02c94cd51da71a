"""GPU partitioning for both vendors: NVIDIA MIG instances and AMD compute/memory partitions.

One home for what splitting a GPU involves, from the plan to the node:

- :mod:`~hetsched.partition.mig`: MIG geometry: which instances fit one GPU, and where.
- :mod:`~hetsched.partition.layouts`: the partition layouts a pool's GPUs may take (MIG layouts, AMD modes).
- :mod:`~hetsched.partition.naming`: names of configs, instances and the resources they show up as.
- :mod:`~hetsched.partition.labels`: the node-label keys and states the vendors' managers read and write.
- :mod:`~hetsched.partition.types`: the config entries a plan holds for those managers.
- :mod:`~hetsched.partition.render`: the one mig-parted renderer and the one Device Config Manager renderer.
- :mod:`~hetsched.partition.phases`: the per-node phase machine from the planned config to the manager's success.

Everything here is pure: no I/O, no cluster or web libraries.
"""
