"""The run directory's layout: which file of a run holds what. Pure: paths only."""

from __future__ import annotations

import dataclasses
from pathlib import Path

__all__ = ["RANK_FILES", "RunDir"]


# The files a run directory holds for each rank (named by its global rank), which a node's
# directory hands to the run's when a multi-node run ends.
RANK_FILES = ("rank-", "result-", "error-", "stacks-", "metrics-", "sample-", "torchelastic-error-")


@dataclasses.dataclass(frozen=True)
class RunDir:
    """The files of one run. The job, results and errors live here, not on a socket."""

    path: Path

    @property
    def job(self) -> Path:
        return self.path / "job.pkl"

    @property
    def launch(self) -> Path:
        """JSON the launcher reads: ranks, timing, the kernel's socket."""
        return self.path / "launch.json"

    @property
    def key(self) -> Path:
        """The per-run HMAC key that signs every message on the wire."""
        return self.path / "key"

    @property
    def outcome(self) -> Path:
        """JSON the launcher writes last: how the run ended and each rank's exit."""
        return self.path / "outcome.json"

    @property
    def launcher_log(self) -> Path:
        return self.path / "launcher.log"

    def log(self, rank: int) -> Path:
        return self.path / f"rank-{rank}.log"

    def stacks(self, rank: int) -> Path:
        """Where a rank's faulthandler writes its threads' stacks when the launcher asks."""
        return self.path / f"stacks-{rank}.txt"

    def metrics(self, rank: int) -> Path:
        """Every ``log_metrics`` record of a rank, one JSON object a line (the wire may drop some)."""
        return self.path / f"metrics-{rank}.jsonl"

    def last_sample(self, rank: int) -> Path:
        """A rank's last memory sample (its peaks), which the wire may drop behind a flood."""
        return self.path / f"sample-{rank}.json"

    def result(self, rank: int) -> Path:
        return self.path / f"result-{rank}.pkl"

    def error(self, rank: int) -> Path:
        return self.path / f"error-{rank}.json"

    def torchelastic_error(self, rank: int) -> Path:
        """The ``TORCHELASTIC_ERROR_FILE`` of a rank (torch's ``@record`` writes it)."""
        return self.path / f"torchelastic-error-{rank}.json"

    def node(self, node_rank: int) -> RunDir:
        """The run directory of one node's launcher in a multi-node run."""
        return RunDir(self.path / "nodes" / f"node-{node_rank}")

    def attempt(self, restart_count: int) -> Path:
        """Where the error and stack files of an attempt that was restarted are kept."""
        return self.path / f"attempt-{restart_count}"

    @property
    def names(self) -> Path:
        """A session call's: the names rank 0's namespace holds after the call."""
        return self.path / "names.json"

    def profile(self, rank: int) -> Path:
        """A rank's profile summary (``profile=True``); its trace is in ``profile/``."""
        return self.path / f"profile-{rank}.json"

    @property
    def sources(self) -> Path:
        """The source of the notebook cells the job's code was defined in (JSON, file name to
        text): pdb in a rank shows and lists their lines as it would a file's."""
        return self.path / "sources.json"

    def notebook_main(self, rank: int) -> Path:
        """The notebook's classes and functions, for spawn-started children of a rank."""
        return self.path / f"main-{rank}.pkl"
