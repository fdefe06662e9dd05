"""The scheduler: tensor graph -> kernels (fusion) -> ordered ExecItems. See kernelize.py, indexing.py, linear.py."""
from fusegrad.schedule.kernelize import kernelize_map, is_realized, buffer_of
from fusegrad.schedule.linear import kernels_in_order, get_buffer, buffer_map

__all__ = ["kernelize_map", "is_realized", "buffer_of", "kernels_in_order", "get_buffer", "buffer_map"]
