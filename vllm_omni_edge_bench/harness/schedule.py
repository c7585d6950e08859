"""The order passes run in: interleaved, A B C A B C ..., never A A A B B B.

Interleaving spreads slow drift of the box (thermal state, page cache, a
neighbour's load) over every arm instead of charging it to whichever arm ran
last. Rotating the first arm of each pass also spreads "first after a pause".
Reversing every other pass (A B C, C B A, ...) changes which arm each one follows: in a
fixed cyclic order an arm always runs right after the same neighbour, and whatever that
neighbour leaves behind (freed memory, page cache, a warm or a cold box) is charged to it.
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


def interleaved(arms: list[str], passes: int, rotate_start: bool = False,
                reverse_alternate: bool = False) -> list[ScheduledPass]:
    if not arms:
        raise ValueError("no arms to schedule")
    order: list[ScheduledPass] = []
    for p in range(passes):
        shift = p % len(arms) if rotate_start else 0
        this = arms[shift:] + arms[:shift]
        if reverse_alternate and p % 2:
            this = this[::-1]
            if order and len(this) > 1 and this[0] == order[-1].arm:
                this = this[1:] + this[:1]  # never the same arm twice in a row across passes
        for arm in this:
            order.append(ScheduledPass(seq=len(order) + 1, pass_index=p + 1, arm=arm))
    return order
