"""``scaling.env`` and ``scaling.network_profile``: the environment every training worker gets.

Clusters need NCCL (and gloo) settings on every worker: which interface to use, whether InfiniBand
is there, how far peer-to-peer may reach. ``scaling.network_profile`` fills the NCCL variables
NVIDIA's guides give per kind of interconnect (docs/gpu.md says where each comes from);
``scaling.env`` sets any variable and wins over the profile. Both reach the workers through Ray's
runtime environment (``driver/run.build_trainer``), over what the node's own environment says.

Starting points, not tuning: measure with ``trainforge bench collectives`` on your cluster and
override in ``scaling.env``. Interface names (``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``) are
the site's and are never guessed here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_ENV_VARS = 256
MAX_ENV_VALUE = 4096

# Set by Ray or Ray Train for each worker, or by trainforge itself: a user's value would break
# the worker group (ranks, devices, the run's own imports), so they are refused by name.
RESERVED = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NODE_RANK",
        "PYTHONPATH",
        "RANK",
        "WORLD_SIZE",
        "TRAINFORGE_SUBMIT_SECRETS",
    }
)
RESERVED_PREFIXES = ("RAY_",)

# What each kind of interconnect wants of NCCL (NCCL's environment-variable documentation and its
# best-practices guide; the requirements' "NCCL Optimization" list). Left out on purpose:
# NCCL_SOCKET_IFNAME (the site's interface name) and NCCL_DEBUG (INFO is for troubleshooting:
# set it in scaling.env when you need it).
NETWORK_PROFILES: dict[str, dict[str, str]] = {
    # One node, GPUs joined by NVLink/NVSwitch: peer-to-peer over NVLink, no network transport.
    "nvlink": {"NCCL_P2P_LEVEL": "NVL", "NCCL_IB_DISABLE": "1"},
    # Nodes on InfiniBand (or RoCE): NCCL's IB transport, GPUDirect RDMA when the GPU and the NIC
    # share a PCIe host bridge, NVLink inside each node.
    "infiniband": {"NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_P2P_LEVEL": "NVL"},
    # Nodes on plain TCP Ethernet: no IB probing, more sockets and threads per connection to fill
    # a 10-100 Gbit/s link, NVLink inside each node.
    "ethernet": {
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_NTHREADS": "4",
        "NCCL_NSOCKS_PERTHREAD": "4",
        "NCCL_P2P_LEVEL": "NVL",
    },
    # Cloud VMs on a virtual network (no InfiniBand exposed): TCP sockets as for Ethernet, with
    # NCCL's own cap on sockets x threads (64); provider fabrics (AWS EFA, GCP GPUDirect-TCPX) need
    # their own plugin and variables in scaling.env.
    "cloud": {
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_NTHREADS": "8",
        "NCCL_NSOCKS_PERTHREAD": "2",
        "NCCL_P2P_LEVEL": "NVL",
    },
}


def env_problem(name: str) -> str | None:
    """Why ``name`` cannot be set through ``scaling.env`` (None: it can)."""
    if not ENV_NAME.fullmatch(name):
        return "is not an environment variable name (letters, digits and _, not starting with a digit)"
    if name in RESERVED or name.startswith(RESERVED_PREFIXES):
        return "is set by Ray or trainforge for each worker and cannot be overridden"
    return None


def env_value(name: str, value: Any) -> str:
    """A ``scaling.env`` value as the string the environment holds (numbers and booleans as YAML
    wrote them); ValueError naming what is wrong."""
    if isinstance(value, bool):
        text = "1" if value else "0"
    elif isinstance(value, (int, float, str)):
        text = str(value)
    else:
        raise ValueError(f"{name}: a string or a number, not {type(value).__name__}")
    if "\0" in text or len(text) > MAX_ENV_VALUE:
        raise ValueError(f"{name}: at most {MAX_ENV_VALUE} characters and no NUL")
    return text


def worker_variables(profile: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """The variables trainforge sets on every worker beyond its own: the profile's, then
    ``scaling.env`` over them."""
    return {**(NETWORK_PROFILES[profile] if profile else {}), **env}


__all__ = ["NETWORK_PROFILES", "env_problem", "env_value", "worker_variables"]
