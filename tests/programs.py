"""Tiny rank programs used as test data. Ranks import this module by name,
as they would a helper module next to a notebook."""

from __future__ import annotations

import os
import signal
import sys
import time


def rank_and_value(value):
    return int(os.environ["RANK"]) * value


def environment():
    return {key: os.environ.get(key) for key in sorted(os.environ)}


def read_stdin():
    try:
        return input()
    except EOFError as error:
        return f"EOFError: {error}"


def raise_on_rank(failing_rank, message, delay=0.0):
    """The failing rank raises; the others wait in a collective that never completes."""
    import torch.distributed as dist

    import nbshard

    nbshard.init_process_group()
    if dist.get_rank() == failing_rank:
        time.sleep(delay)
        helper_that_raises(message)
    dist.barrier()  # blocks forever: the failing rank never joins
    return "unreachable"


def helper_that_raises(message):
    raise ValueError(message)


def kill_self(rank, signum):
    if int(os.environ["RANK"]) == rank:
        os.kill(os.getpid(), signum)
    time.sleep(60)


def exit_hard(rank, code):
    if int(os.environ["RANK"]) == rank:
        os._exit(code)
    time.sleep(60)


def remove_own_run_dir():
    """Rank 0 deletes the run's directory (its files, the other rank's logs) while the job runs."""
    import shutil

    if os.environ["RANK"] == "0":
        shutil.rmtree(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"]))
    time.sleep(0.5)
    return "removed"


def sleep_forever(message="working"):
    print(message, flush=True)
    while True:
        time.sleep(0.1)


def wait_in_collective():
    """Rank 0 blocks in a barrier that rank 1 never reaches."""
    import torch.distributed as dist

    import nbshard

    nbshard.init_process_group()
    print(f"rank {dist.get_rank()} ready", flush=True)
    if dist.get_rank() == 0:
        dist.barrier()
    else:
        time.sleep(600)


def ddp_losses(steps):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import nbshard

    nbshard.init_process_group()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(64, 8, generator=data)
    y = x @ torch.arange(8.0)[:, None]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # DDP keeps replicas identical: every rank must end with the same weights.
    weights = [torch.zeros_like(model.module.weight) for _ in range(dist.get_world_size())]
    dist.all_gather(weights, model.module.weight.detach())
    return {"losses": losses, "replicas_equal": all(torch.equal(w, weights[0]) for w in weights)}


def fsdp2_step():
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import nbshard

    nbshard.init_process_group()
    device = nbshard.device()  # the rank's GPU under NCCL, the CPU under gloo
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    weight = model[0].weight
    return {
        "losses": losses,
        "local_shape": tuple(weight.to_local().shape),
        "full_shape": tuple(weight.full_tensor().shape),
        "full_weight": weight.full_tensor(),  # gathered: a plain tensor travels back
    }


def return_dtensor():
    import torch
    from torch.distributed.fsdp import fully_shard

    import nbshard

    nbshard.init_process_group()
    model = torch.nn.Linear(4, 4)
    fully_shard(model)
    return model.weight


def allreduce_sum():
    import torch
    import torch.distributed as dist

    import nbshard

    nbshard.init_process_group()
    tensor = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    return tensor


def print_lines(count, width=40):
    rank = os.environ["RANK"]
    write = sys.stdout.write
    for index in range(count):
        write(f"{rank}:{index}:{'x' * width}\n")
    sys.stdout.flush()
    return count


def progress_bar(steps):
    for step in range(steps + 1):
        sys.stderr.write(f"\rprogress {step}/{steps}")
        sys.stderr.flush()
        time.sleep(0.02)
    sys.stderr.write("\n")
    print("finished")


def stdout_and_stderr_fd():
    """Writes straight to file descriptors 1 and 2, as C++ and NCCL do."""
    os.write(1, b"from fd 1\n")
    os.write(2, b"from fd 2\n")


def uses_port():
    return os.environ["MASTER_PORT"]


def install_atexit_marker(path):
    import atexit

    atexit.register(lambda: open(path, "w").write("atexit ran"))
    return "ok"


def terminate_checkpoint(path):
    """Writes a checkpoint when asked to stop with SIGTERM, as Lightning can."""

    def save(signum, frame):
        with open(f"{path}.{os.environ['RANK']}", "w") as file:
            file.write("saved on SIGTERM")
        sys.exit(0)

    signal.signal(signal.SIGTERM, save)
    print("ready", flush=True)
    while True:
        time.sleep(0.05)


def store_on_port(port):
    """Rank 0 serves a TCPStore of the job's own on ``port`` (as a launcher inside the job would)."""
    import torch.distributed as dist

    if os.environ["RANK"] == "0":
        dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    time.sleep(30)


def grab_master_port_once(marker):
    """On the first attempt, rank 0 holds MASTER_PORT before torch can bind it."""
    import socket

    if os.environ["RANK"] == "0" and not os.path.exists(marker):
        open(marker, "w").close()
        blocker = socket.socket()
        blocker.bind(("", int(os.environ["MASTER_PORT"])))
        blocker.listen()
    total = allreduce_sum().item()
    return total, os.environ["MASTER_PORT"], os.environ["TORCHELASTIC_RESTART_COUNT"]


def start_escaping_child(pid_file, then="return"):
    """Start a process in a new session (as a daemon would), note its pid, then end as asked."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    written = f"{pid_file}-writing{os.environ['RANK']}"  # the test looks for the file: it appears whole
    with open(written, "w") as file:
        file.write(str(child.pid))
    os.replace(written, f"{pid_file}.{os.environ['RANK']}")
    print("child started", flush=True)
    if then == "raise":
        # Not before every rank started its child: the launcher stops the others once one raised.
        deadline = time.monotonic() + 30
        while not all(os.path.exists(f"{pid_file}.{rank}") for rank in range(int(os.environ["WORLD_SIZE"]))):
            assert time.monotonic() < deadline, "the other ranks never started their children"
            time.sleep(0.01)
        raise RuntimeError("failing with a child in another session")
    if then == "wait":
        time.sleep(600)
    return child.pid


def big_result(megabytes):
    """A tensor of ``megabytes``, and this rank's resident memory just before returning it."""
    import torch

    tensor = torch.ones(megabytes * 1024 * 1024 // 4)
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return tensor, resident


def process_state():
    """What user code can see of the process it runs in, with the run's own names replaced
    by placeholders: a warm (forked) rank must report exactly what a cold one does."""
    import ctypes
    import random
    import subprocess

    import torch

    run_dir = os.environ["TORCHELASTIC_ERROR_FILE"].rsplit("/", 1)[0]
    per_run = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "NBSHARD_LAUNCHER_PID", "NBSHARD_NOTEBOOK_MAIN"}

    def plain(text):
        return str(text).replace(run_dir, "RUN_DIR").replace(f"/proc/{os.getpid()}/", "/proc/PID/")

    def disposition(handler):
        names = {signal.SIG_DFL: "default", signal.SIG_IGN: "ignored", signal.default_int_handler: "KeyboardInterrupt"}
        return names.get(handler, "python handler" if callable(handler) else repr(handler))

    def fd_kind(fd):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # listdir's own, closed since
            return None
        for kind in ("pipe:", "socket:", "anon_inode:"):
            if target.startswith(kind):
                return target.split("[")[0]
        return plain(target)

    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    c_environ = ctypes.POINTER(ctypes.c_char_p).in_dll(libc, "environ")
    c_names, i = set(), 0
    while c_environ[i]:
        c_names.add(c_environ[i].split(b"=", 1)[0].decode())
        i += 1
    main = sys.modules["__main__"]
    time.sleep(0.5)  # ZeroMQ's I/O thread opens its TCP connection to the kernel in its own time
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    return {
        "signals": {signal.Signals(s).name: disposition(signal.getsignal(s)) for s in sorted(signal.valid_signals())
                    if s not in (signal.SIGKILL, signal.SIGSTOP) and s < signal.SIGRTMIN},
        "signal masks": {k: status[k].strip() for k in ("SigBlk", "SigIgn", "SigCgt")},
        "fds": sorted(kind for fd in fds if (kind := fd_kind(fd)) is not None),  # numbers race with the sampler thread
        "stdio": [
            {k: plain(getattr(stream, k)) for k in ("name", "mode", "encoding", "errors", "line_buffering", "write_through")}
            | {"buffer": type(stream.buffer).__name__, "fileno": stream.fileno(), "is __std__": stream is getattr(sys, f"__{n}__")}
            for n, stream in (("stdin", sys.stdin), ("stdout", sys.stdout), ("stderr", sys.stderr))
        ],
        "environ": {k: v for k, v in os.environ.items() if k not in per_run},
        "C environ agrees": c_names == set(os.environ) and all(libc.getenv(k.encode()) == os.environ[k].encode() for k in os.environ),
        "cwd": os.getcwd(),
        "__main__": sorted(vars(main)),
        "__main__ file": (plain(main.__file__), getattr(main.__spec__, "name", None), main.__package__, main.__name__),
        "argv": [plain(a) for a in sys.argv],
        "orig_argv": [plain(a) for a in sys.orig_argv],
        "path": [plain(p) for p in sys.path],
        "ps": plain(subprocess.run(["ps", "-o", "args=", "-p", str(os.getpid())], capture_output=True, text=True).stdout.strip()),
        "comm": open("/proc/self/comm").read().strip(),
        "threads": (torch.get_num_threads(), torch.get_num_interop_threads()),
        "seed": torch.initial_seed(),
        "random": random.random(),
        "process group leader": os.getpgrp() == os.getppid(),  # the launcher leads the ranks' group
        "session": os.getsid(0) == os.getppid(),
        "umask": os.umask(os.umask(0o22)),
        "atexit handlers": __import__("atexit")._ncallbacks(),
    }


def launcher_state(hold: float = 0.0):
    """What the rank's launcher (its parent) holds, as /proc shows it, with the run's names
    replaced: a spare launcher must hold exactly what one forked at the request does (its
    environment is what its ranks get, compared elsewhere: /proc shows the block it was
    started with). Rank 0 then waits ``hold`` seconds (rank 1 waits for it)."""
    import torch.distributed as dist

    launcher = os.getppid()
    run_dir = os.environ["TORCHELASTIC_ERROR_FILE"].rsplit("/", 1)[0]

    def plain(text):
        return str(text).replace(run_dir, "RUN_DIR")

    def fd_kind(fd):
        try:
            target = os.readlink(f"/proc/{launcher}/fd/{fd}")
        except FileNotFoundError:
            return None
        return target.split("[")[0] if target.startswith(("pipe:", "socket:", "anon_inode:")) else plain(target)

    time.sleep(0.3)  # ZeroMQ's I/O thread opens its connection in its own time
    status = dict(line.split(":\t", 1) for line in open(f"/proc/{launcher}/status").read().splitlines() if ":\t" in line)
    stat = open(f"/proc/{launcher}/stat").read().rsplit(")", 1)[1].split()
    state = {
        "fds": {int(fd): fd_kind(fd) for fd in os.listdir(f"/proc/{launcher}/fd")},
        "cmdline": plain(open(f"/proc/{launcher}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()),
        "signal masks": {k: status[k].strip() for k in ("SigBlk", "SigIgn", "SigCgt")},
        "threads": int(status["Threads"]),
        "session leader": int(stat[3]) == launcher,  # the sid field
        "cwd": os.readlink(f"/proc/{launcher}/cwd"),
    }
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        time.sleep(hold)
    dist.barrier()
    dist.destroy_process_group()
    return state


def finish_in_background(prefix):
    """Leave a thread and a ThreadPoolExecutor writing a file each after the function returned."""
    import concurrent.futures
    import threading

    def write(kind):
        time.sleep(0.5)
        with open(f"{prefix}-{kind}-{os.environ['RANK']}", "w") as file:
            file.write("written")

    threading.Thread(target=write, args=("thread",)).start()
    concurrent.futures.ThreadPoolExecutor(1).submit(write, "pool")
    return int(os.environ["RANK"])


def spin_forever():
    while True:
        time.sleep(0.05)


def leave_a_thread_spinning(raising_rank=None):
    """Every rank starts a thread that never ends (not a daemon); ``raising_rank`` then raises."""
    import threading

    threading.Thread(target=spin_forever, name="spinning").start()
    if int(os.environ["RANK"]) == raising_rank:
        raise ValueError("raised beside a thread that never ends")
    return f"value of rank {os.environ['RANK']}"


def hang_at_exit(value):
    import atexit

    atexit.register(time.sleep, 600)
    return value


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text for this error")


def raise_unprintable():
    raise Unprintable()


def pass_a_breakpoint():
    """``breakpoint()``, then a value: with nobody to answer (no notebook), the rank goes on."""
    breakpoint()
    return "went on"
