"""The order passes run in: interleaved, A B C A B C ..., never A A A B B B.

Interleaving spreads slow drift of the box (thermal state, page cache, a
neighbour's load) over every arm instead of charging it to whichever arm ran
last. Rotating the first arm of each pass also spreads "first after a pause".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledPass:
    seq: int  # 1-based position in the whole run
    pass_index: int  # 1-based pass number; arm pass i is compared with control pass i
    arm: str

    @property
    def stem(self) -> str:
        return f"{self.pass_index:02d}-{self.arm}"


def interleaved(arms: list[str], passes: int, rotate_start: bool = False) -> list[ScheduledPass]:
    if not arms:
        raise ValueError("no arms to schedule")
    order = []
    for p in range(passes):
        shift = p % len(arms) if rotate_start else 0
        for arm in arms[shift:] + arms[:shift]:
            order.append(ScheduledPass(seq=len(order) + 1, pass_index=p + 1, arm=arm))
    return order
