"""A local Ray instance bound to loopback, and the loopback test (the ray extra, imported
lazily: this module imports nothing of Ray at its top).

Binding: the local Ray instance start_local_ray starts binds every service it starts -- GCS,
raylet, object manager, the workers, the agents -- to 127.0.0.1, unless `node_ip` names
another address (the one other nodes reach this one at). Ray binds its gRPC servers to
loopback only when the node address is 127.0.0.1, and replaces a loopback address asked for
by the machine's outward one unless its single-machine switch is off
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, ray_constants.ENABLE_RAY_CLUSTER): start_local_ray
turns it off while Ray starts, in the environment Ray's processes inherit too, and checks
the address Ray reports. Used by `colibri serve --ray` (colibri.server.ray_serve) and the
expert shards (colibri.experts.expert_shards).
"""
from __future__ import annotations

import ipaddress
import os
import socket

from .errors import ColibriError

__all__ = ["LOOPBACK", "is_loopback", "start_local_ray"]

LOOPBACK = "127.0.0.1"
RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"   # Ray's; "0": one machine


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address (127.0.0.0/8, ::1);
    a name that does not resolve counts as not loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)



def start_local_ray(node_ip: str = LOOPBACK, **options) -> dict:
    """ray.init of a new local instance without the dashboard whose services bind node_ip
    (default 127.0.0.1: this machine only); its address_info. ColibriError (after shutting
    it down) when Ray bound another address than the loopback one asked for (a Ray that
    picks its address another way)."""
    import ray
    from ray._private import ray_constants      # the switch, as Ray read it at import
    local = is_loopback(node_ip)
    saved = (ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(RAY_CLUSTER_SWITCH))
    if local:
        ray_constants.ENABLE_RAY_CLUSTER = False
        os.environ[RAY_CLUSTER_SWITCH] = "0"    # for Ray's processes, started from here
    try:
        info = ray.init(include_dashboard=False, _node_ip_address=node_ip,
                        **options).address_info
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved[0]
        if saved[1] is None:
            os.environ.pop(RAY_CLUSTER_SWITCH, None)
        else:
            os.environ[RAY_CLUSTER_SWITCH] = saved[1]
    if local and not is_loopback(info["node_ip_address"]):
        ray.shutdown()
        raise ColibriError(f"Ray bound its services to {info['node_ip_address']}, not "
                           f"{node_ip} as asked; start Ray yourself (ray start --head "
                           f"--node-ip-address {node_ip}) and give --ray-address")
    return info
