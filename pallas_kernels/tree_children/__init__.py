"""The greedy children of a draft tree's frontier without their logits in HBM: `top_children`;
oracle `ref_top_children`."""

from pallas_kernels.tree_children.kernel import ref_top_children, top_children

__all__ = ["ref_top_children", "top_children"]
