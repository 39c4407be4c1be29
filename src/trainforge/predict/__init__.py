"""``trainforge predict``: step time, throughput and scaling efficiency per GPU count, before renting them.

``links``: alpha-beta presets of common links, or one measured by ``trainforge bench collectives``;
``model``: ring collectives (hierarchical across nodes) and their overlap with the backward pass;
``inputs``: gradient bytes and compute time per step of a config's model, measured on this machine;
``render``: the table, the JSON and the cost per epoch. Everything runs in the driver's process, no Ray.
"""
