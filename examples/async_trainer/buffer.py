"""Data Buffer: samples keyed by prompt instance id; a group is ready when all G are in."""
from collections import defaultdict


class DataBuffer:
    def __init__(self, group_size: int):
        self.group_size = group_size
        self._groups = defaultdict(list)
        self._consumed = set()

    def add(self, sample: dict) -> None:
        pid = sample["prompt_id"]
        if pid in self._consumed:
            raise ValueError(f"sample for prompt_id {pid} arrived after its group was consumed")
        self._groups[pid].append(sample)
        if len(self._groups[pid]) > self.group_size:
            raise ValueError(f"prompt_id {pid} has more than group_size={self.group_size} samples")

    def pop_ready(self, max_groups: int):
        """Remove and return up to ``max_groups`` complete groups (each consumed exactly once)."""
        ready = [pid for pid, s in self._groups.items() if len(s) == self.group_size][:max_groups]
        out = []
        for pid in ready:
            out.append(self._groups.pop(pid))
            self._consumed.add(pid)
        return out
