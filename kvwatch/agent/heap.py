"""The daemon's heap after start-up, kept out of the garbage collector's full passes.

A full (generation 2) collection walks every container object alive, and runs on the event loop
whenever allocations trigger it: the ~50,000 objects of the imported modules, classes and config
cost 20-60 ms per pass on a busy 2-core node (``gc.callbacks``), a stall every proxied chunk and
scrape waits out. They live until exit, so ``gc.freeze()`` moves them to the permanent generation
once start-up is done, as the ``gc`` documentation suggests for long-running servers; objects
created later are collected as before.
"""

from __future__ import annotations

import gc


def freeze_start_up_heap() -> None:
    """Collect what start-up left behind, then freeze the rest (call once, after ``Agent.start``)."""
    gc.collect()
    gc.freeze()
