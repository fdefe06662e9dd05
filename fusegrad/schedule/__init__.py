"""The scheduler: tensor graph -> kernels (fusion) -> ordered ExecItems. See kernelize.py, indexing.py, linear.py."""
from fusegrad.schedule.kernelize import kernelize_map
from fusegrad.schedule.linear import kernels_in_order

__all__ = ["kernelize_map", "kernels_in_order"]
