"""Data Buffer: samples keyed by prompt instance id (dict of lists); a group is ready when all
G samples of its prompt are in, and each group is handed out exactly once."""
from collections import defaultdict


class DataBuffer:
    def __init__(self, group_size: int):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        self._groups = defaultdict(list)
        self._consumed = set()

    def add(self, sample: dict) -> None:
        pid = sample["prompt_id"]
        if pid in self._consumed:
            raise ValueError(f"sample for prompt_id {pid} arrived after its group was consumed")
        if len(self._groups[pid]) == self.group_size:
            raise ValueError(f"prompt_id {pid} has more than group_size={self.group_size} samples")
        self._groups[pid].append(sample)

    def pop_ready(self, max_groups: int):
        """Remove and return up to ``max_groups`` complete groups (each consumed exactly once)."""
        ready = [pid for pid, s in self._groups.items() if len(s) == self.group_size][:max_groups]
        out = []
        for pid in ready:
            out.append(self._groups.pop(pid))
            self._consumed.add(pid)
        return out

    def pending(self) -> int:
        """Samples held in groups not handed out yet."""
        return sum(len(s) for s in self._groups.values())
