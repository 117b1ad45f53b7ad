"""Process layout, groups, MoE token exchange and the MoE parallel plan."""

from expertmesh.distributed.all2all import (
    ALL2ALL_BACKENDS,
    DEFAULT_ALL2ALL_BACKEND,
    KNOWN_ALL2ALL_BACKENDS,
    All2AllBackend,
    make_all2all,
)
from expertmesh.distributed.group import Group, Traffic, poison_
from expertmesh.distributed.layout import ParallelLayout, check_world_size
from expertmesh.distributed.moe_plan import MoEPlan, expert_owners
from expertmesh.distributed.parallel_groups import ParallelGroups, init_groups

__all__ = [
    "ALL2ALL_BACKENDS",
    "DEFAULT_ALL2ALL_BACKEND",
    "KNOWN_ALL2ALL_BACKENDS",
    "All2AllBackend",
    "Group",
    "MoEPlan",
    "ParallelGroups",
    "ParallelLayout",
    "Traffic",
    "check_world_size",
    "expert_owners",
    "init_groups",
    "make_all2all",
    "poison_",
]
