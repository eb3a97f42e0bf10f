"""Where a serving system's CPU time goes (``bench_ray.py``): py-spy recordings of a process's threads, summarized
per thread (``--profile-servers``), and the CPU time of every process of a command's tree, Ray's included.

Two recordings run side by side over the same seconds: every thread's samples, idle ones included (where each
thread spends its time, waiting too), and only the samples of the thread holding the GIL (which thread the others
wait for; and, against the samples asked for, how much of the time any thread held it). Each is summarized as each
thread's share of the recording's samples and, within a thread, the frames its samples end in: the innermost frame
of ``punica_hf`` code when the stack has one, else the innermost frame.
py-spy's ``--nonblocking`` mode reads the process without stopping it, so the recording does not slow it down.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import NamedTuple

MODES = {"gil": ["--gil"], "threads": ["--idle"]}  # recording name: py-spy flags
_THREAD_ID = re.compile(r"\s*\(\d+\)")  # py-spy's "thread (1234): name": the id differs between runs
_LINE = re.compile(r"\s*\([^()]*:\d+\)$")  # a frame's "(file.py:12)", so one function is one entry


class _Process(NamedTuple):
    parent: int
    command: str  # its command line (a Ray worker's: its title)
    cpu_seconds: float  # user and system time used so far
    started: int  # clock ticks since boot: a pid used again is another process
    nice: int  # its main thread's scheduling priority (Ray starts its workers at 15)


def _processes() -> dict[int, _Process]:
    """Every process of this machine, by pid."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        fields = status[status.rindex(")") + 2:].split()  # after "pid (name) ": state, parent, ...
        found[int(entry.name)] = _Process(int(fields[1]), command, (int(fields[11]) + int(fields[12])) / ticks,
                                          int(fields[19]), int(fields[16]))
    return found


def _below(root: int, processes: dict[int, _Process]) -> list[int]:
    """The processes descending from ``root``."""
    def descends(pid: int) -> bool:
        seen = set()
        while pid in processes and pid not in seen:
            seen.add(pid)
            pid = processes[pid].parent
            if pid == root:
                return True
        return False

    return sorted(pid for pid in processes if descends(pid))


def descendants_of(root: int, marker: str) -> list[int]:
    """The processes descending from process ``root`` whose command line (a Ray worker's: its title) holds
    ``marker`` (a Ray worker has a process group of its own, but descends from the command that started Ray)."""
    processes = _processes()
    return [pid for pid in _below(root, processes) if marker in processes[pid].command]


Reading = dict[tuple[int, int], tuple[str, float, int]]  # (pid, start time) -> (command line, CPU seconds, nice)


def cpu_of_tree(root: int) -> Reading:
    """Process ``root`` and its descendants (a local Ray cluster's too): ``{(pid, start time): (command line, CPU
    seconds used so far, nice value)}``."""
    processes = _processes()
    return {(pid, process.started): (process.command, process.cpu_seconds, process.nice)
            for pid in [root, *_below(root, processes)] if (process := processes.get(pid)) is not None}


def cpu_shares(before: Reading, after: Reading, seconds: float, title_chars: int = 60) -> list[dict]:
    """Each process's CPU time between two ``cpu_of_tree`` readings ``seconds`` apart, as a share of one core
    (1.0: a core busy all along), largest first, with its nice value at the second. A process started between them
    counts from 0; one that ended between them is not counted (its time is gone with it)."""
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    shares = [{"process": f"{pid} {command[:title_chars]}",
               "cpu_share": (used - before.get((pid, started), ("", 0.0, 0))[1]) / seconds, "nice": nice}
              for (pid, started), (command, used, nice) in after.items()]
    return sorted(shares, key=lambda share: -share["cpu_share"])


class Recordings:
    """Both recordings of process ``pid`` for ``seconds``, started at once; ``finish()`` waits for them and returns
    ``{mode: summary}`` (a failed recording: ``{"error": ...}``)."""

    def __init__(self, py_spy: str, pid: int, seconds: float, folder: Path, rate: int = 200) -> None:
        self.seconds = seconds
        self.expected_samples = rate * max(1, round(seconds))
        self.paths = {mode: folder / f"py_spy_{pid}_{mode}.txt" for mode in MODES}
        self.processes = {
            mode: subprocess.Popen(
                [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
                 "--nonblocking", "--threads", "--format", "raw", "--output", str(self.paths[mode]), *flags],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for mode, flags in MODES.items()
        }

    def finish(self) -> dict:
        summaries = {}
        for mode, process in self.processes.items():
            try:
                log, _ = process.communicate(timeout=self.seconds + 60)
            except subprocess.TimeoutExpired:
                process.kill()
                log, _ = process.communicate()
            if process.returncode != 0 or not self.paths[mode].is_file():
                summaries[mode] = {"error": f"py-spy exited with status {process.returncode}: {log[-500:]}"}
            else:
                summaries[mode] = summarize(self.paths[mode].read_text())
        # py-spy falls behind on a busy machine, the --idle recording (every thread's stack at every sample) the
        # most: its ``samples_taken`` (a thread there all along is in every sample) of ``samples_asked`` says how
        # far. The GIL recording keeps the samples where some thread held the GIL: over the samples asked for, how
        # much of the time it was held (a floor, if that recording fell behind too).
        threads, gil = summaries["threads"], summaries["gil"]
        if "error" not in threads:
            threads |= {"samples_asked": self.expected_samples, "samples_taken": threads["most_of_one_thread"]}
        if "error" not in gil:
            gil |= {"samples_asked": self.expected_samples,
                    "gil_held_share": min(1.0, gil["samples"] / self.expected_samples)}
        return summaries


def summarize(raw: str, frames_per_thread: int = 8) -> dict:
    """``{"samples": N, "most_of_one_thread": M, "threads": [{"thread", "share", "frames": [{"frame", "share"}]}]}``
    of py-spy's raw (collapsed stacks) output recorded with ``--threads``: threads by share, each share a fraction of
    all samples (threads of one name together); M, the samples of the most sampled single thread."""
    threads: Counter = Counter()
    frames: dict[str, Counter] = {}
    by_id: Counter = Counter()  # threads of one name (a pool's) apart
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        count = int(count)
        thread, *calls = stack.split(";")
        by_id[thread] += count
        thread = _THREAD_ID.sub("", thread)
        ours = [call for call in calls if "punica_hf" in call]
        frame = _LINE.sub("", (ours or calls or ["?"])[-1])
        total += count
        threads[thread] += count
        frames.setdefault(thread, Counter())[frame] += count
    return {
        "samples": total,
        "most_of_one_thread": max(by_id.values(), default=0),  # one thread's samples, the most sampled one's
        "threads": [
            {"thread": thread, "share": count / total,
             "frames": [{"frame": frame, "share": n / total}
                        for frame, n in frames[thread].most_common(frames_per_thread)]}
            for thread, count in threads.most_common()
        ],
    }
