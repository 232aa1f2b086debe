"""Long Range Arena tasks (Tay et al. 2021, arXiv:2011.04006) built offline into the token-sequence format
``data.kind: sequences`` reads (``mmformer.data.sequences``): generated ListOps and Pathfinder, byte-level
KJV book classification and passage matching (LRA's Text and Retrieval on text that installs offline),
and MNIST digits as pixel sequences (LRA's Image). ``mmformer data prepare NAME`` builds each
(``mmformer.data.prepare``); docs/long_context.md."""

from .kjv import build_kjv_books, build_kjv_pairs
from .listops import build_listops
from .pathfinder import build_pathfinder
from .pixels import build_mnist5k_pixels

__all__ = ["build_kjv_books", "build_kjv_pairs", "build_listops", "build_mnist5k_pixels", "build_pathfinder"]
