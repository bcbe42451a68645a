"""Theoretical PCIe bandwidth of a link as trained: what host-offloaded KV can move at most.

Per lane, per direction, after the physical layer's encoding overhead (TLP/DLLP framing not
subtracted), in bytes per second:

=====  ========  ===================  ==================================  ===============
gen    GT/s      encoding             formula                             MB/s per lane
=====  ========  ===================  ==================================  ===============
1      2.5       8b/10b               2.5e9 x 8/10 / 8                    250
2      5         8b/10b               5e9 x 8/10 / 8                      500
3      8         128b/130b            8e9 x 128/130 / 8                   ~984.6
4      16        128b/130b            16e9 x 128/130 / 8                  ~1969.2
5      32        128b/130b            32e9 x 128/130 / 8                  ~3938.5
6      64 PAM4   1b/1b, 256 B FLIT    64e9 / 8 x 242/256                  7562.5
=====  ========  ===================  ==================================  ===============

Sources: the PCI Express Base Specification's transfer rates and encodings (2.5/5 GT/s 8b/10b;
8/16/32 GT/s 128b/130b; 6.0 at 64 GT/s PAM4 in FLIT mode). A 6.0 FLIT is 256 bytes: 236 TLP +
6 DLP + 8 CRC + 6 FEC (e.g. glennklockwood.com/garden/PCIe-Gen6, citing PCI-SIG and Synopsys). CRC and
FEC play the part line encoding played before, so the comparable payload share is 242/256, giving
the 7.563 GB/s per lane commonly tabulated (and 121 GB/s for x16). A simple 128b/130b analogy
(~7877 MB/s) would overstate it.

An H200 SXM runs Gen5 x16: about 63.0 GB/s per direction.
"""

from __future__ import annotations

#: bytes per second per lane per direction, by PCIe generation
LANE_BYTES_PER_SECOND: dict[int, float] = {
    1: 2.5e9 * 8 / 10 / 8,
    2: 5e9 * 8 / 10 / 8,
    3: 8e9 * 128 / 130 / 8,
    4: 16e9 * 128 / 130 / 8,
    5: 32e9 * 128 / 130 / 8,
    6: 64e9 / 8 * 242 / 256,
}


def link_bytes_per_second(generation: int | None, width: int | None) -> float | None:
    """One-direction bandwidth of a link trained at ``generation`` x ``width``; None if unknown."""
    if generation is None or width is None or width <= 0:
        return None
    per_lane = LANE_BYTES_PER_SECOND.get(generation)
    return None if per_lane is None else per_lane * width
