"""What a distributed fit exposes and leaves behind, tried as an attacker and an unlucky user.

Real worker processes and gloo on 127.0.0.1; a real 30 MiB tmpfs where the
machine lets this process mount one.
"""

import contextlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import alive, wait_for, worker_pids

from sklearn_casgd import (
    CASGDLinearRegression,
    CASGDLogisticRegression,
    DistributedFitError,
    WorkerPool,
    close_worker_pools,
)
from sklearn_casgd._distributed import launch, rundir
from sklearn_casgd.datasets import make_glm_data

pytestmark = pytest.mark.distributed

JOB_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def socket_inodes(pid):
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def listening_sockets(pid="self"):
    """``inode -> (address hex, port)`` of every TCP socket in LISTEN state.

    In the network namespace of process ``pid`` (this one's by default).
    """
    found = {}
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    address, port = fields[1].split(":")
                    found[fields[9]] = (address, int(port, 16))
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1


def shm_runs():
    return {p.name for p in Path(rundir.SHARED_MEMORY_DIR).glob("sklearn_casgd_*")}


def long_fit_in_thread(n_devices=2, **params):
    """Start a fit of a few seconds in a thread; return (thread, outcome dict)."""
    X, y, _ = make_glm_data("logistic", 4000, 16, random_state=0)
    outcome = {}
    estimator = CASGDLogisticRegression(
        n_devices=n_devices, device="cpu", solver="sgd", s=8, max_iter=150, tol=None,
        random_state=0, **params,
    )  # fmt: skip

    def run():
        try:
            outcome["estimator"] = estimator.fit(X, y)
        except Exception as error:  # reported to the test
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome, (X, y)


@pytest.fixture(params=[True, False], ids=["private-network", "host-network"])
def network(request, monkeypatch):
    """Workers in a network namespace of their own (where Linux allows it), or on the host's."""
    monkeypatch.setattr(launch, "PRIVATE_NETWORK", request.param)
    close_worker_pools()  # the next fit starts workers on that network
    yield request.param
    close_worker_pools()


def namespace(pid):
    return os.readlink(f"/proc/{pid}/ns/net")


def test_nothing_listens_beyond_loopback_and_the_parent_listens_nowhere(network):
    thread, outcome, _ = long_fit_in_thread()
    seen_worker_listeners = set()
    try:
        assert wait_for(lambda: len(worker_pids(os.getpid())) == 2, 60)
        while thread.is_alive():
            assert not socket_inodes(os.getpid()) & set(listening_sockets())  # no store socket
            for pid in worker_pids(os.getpid()):
                listeners = listening_sockets(pid)  # in the worker's network
                for inode in socket_inodes(pid) & set(listeners):
                    address, port = listeners[inode]
                    assert address in LOOPBACK, f"worker {pid} listens on {address}:{port}"
                    seen_worker_listeners.add(port)
            time.sleep(0.05)
    finally:
        thread.join()
    assert "error" not in outcome, outcome.get("error")
    assert seen_worker_listeners  # gloo's own connections were seen, on loopback


def test_workers_in_a_private_network_cannot_be_reached_from_outside_it(monkeypatch):
    """Their loopback is theirs: a port they listen on refuses this process's connections."""
    monkeypatch.setattr(launch, "PRIVATE_NETWORK", True)
    close_worker_pools()
    X, y, _ = make_glm_data("linear", 200, 4, random_state=0)
    CASGDLinearRegression(n_devices=2, device="cpu", max_iter=1, tol=None).fit(X, y)
    workers = launch.pool_for(2)._slot[0]
    if not workers.private_network:
        pytest.skip("this system does not allow an unprivileged network namespace")
    pids = workers.pids()
    assert namespace(pids[0]) == namespace(pids[1]) != namespace("self")
    ours = {port for _, port in listening_sockets().values()}
    ports = {port for pid in pids for _, port in listening_sockets(pid).values()} - ours
    assert ports  # gloo listens, in the workers' network
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    status = Path(f"/proc/{pids[0]}/status").read_text().splitlines()
    uid = next(line for line in status if line.startswith("Uid:")).split()[1]
    assert uid == str(os.getuid())  # mapped to itself: files keep their owner
    close_worker_pools()


def test_a_client_on_loopback_cannot_run_code_or_change_the_result(tmp_path, monkeypatch):
    """Connect to every listening port of the fit and send a pickle that would run code.

    On the host's loopback, where workers run when the system refuses them a
    network of their own.
    """
    monkeypatch.setattr(launch, "PRIVATE_NETWORK", False)
    close_worker_pools()
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    evil = pickle.dumps(Payload())
    thread, outcome, (X, y) = long_fit_in_thread()
    try:
        assert wait_for(lambda: len(worker_pids(os.getpid())) == 2, 60)
        while thread.is_alive():
            listeners = listening_sockets()
            for pid in [os.getpid(), *worker_pids(os.getpid())]:
                for inode in socket_inodes(pid) & set(listeners):
                    _, port = listeners[inode]
                    with (
                        contextlib.suppress(OSError),
                        socket.create_connection(("127.0.0.1", port), timeout=0.5) as client,
                    ):
                        client.sendall(evil)
            time.sleep(0.1)
    finally:
        thread.join()
    assert not marker.exists()
    if "error" in outcome:  # a disturbed gloo connection may end the fit, never silently
        assert isinstance(outcome["error"], DistributedFitError)
        return
    reference = CASGDLogisticRegression(
        n_devices=1, device="cpu", solver="sgd", s=8, max_iter=150, tol=None, random_state=0
    ).fit(X, y)
    np.testing.assert_allclose(outcome["estimator"].coef_, reference.coef_, rtol=1e-5, atol=1e-6)


def test_run_and_pool_directories_are_private_and_removed(monkeypatch):
    made = []
    for name in ("make_run_dir", "make_pool_dir"):
        make = getattr(rundir, name)

        def spy(*args, make=make):
            path = make(*args)
            made.append((path, os.stat(path).st_mode & 0o777))
            return path

        monkeypatch.setattr(rundir, name, spy)
    X, y, _ = make_glm_data("linear", 200, 4, random_state=0)
    with WorkerPool(2):
        CASGDLinearRegression(n_devices=2, device="cpu", max_iter=2, tol=None).fit(X, y)
        (pool_dir, pool_mode), (run_dir, run_mode) = made
        assert "_pool_" in pool_dir and pool_mode == run_mode == 0o700
        assert not Path(run_dir).exists()  # removed when the fit ends
        assert Path(pool_dir).exists()
    assert not Path(pool_dir).exists()  # and the pool's when it closes


KILL_SCRIPT = """
from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd.datasets import make_glm_data
X, y, _ = make_glm_data("logistic", 20000, 16, random_state=0)
print("fitting", flush=True)
CASGDLogisticRegression(n_devices=2, device="cpu", solver="sgd", max_iter=100000, tol=None,
                        s=4).fit(X, y)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_killed_parent_leaves_no_worker_and_no_directory(how):
    before = shm_runs()
    parent = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT], env=JOB_ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout.readline().strip() == "fitting"
        assert wait_for(lambda: len(worker_pids(parent.pid)) == 2, 60)
        workers = worker_pids(parent.pid)
        time.sleep(1.0)  # well inside the fit: blocks mapped, group formed
        parent.send_signal(how)
        parent.wait(timeout=10)
        assert wait_for(lambda: not any(alive(pid) for pid in workers), 10)
        assert wait_for(lambda: shm_runs() <= before, 10), shm_runs() - before
    finally:
        parent.kill()
        parent.wait()


def test_a_dead_parents_run_directory_is_removed_by_the_next_fit(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = Path(rundir.SHARED_MEMORY_DIR) / f"sklearn_casgd_{dead.pid}_leftover"
    leftover.mkdir()
    (leftover / "X_block_0.bin").write_bytes(b"\0" * 1024)
    # Made a while ago: an unlocked directory seconds old may be a run being made.
    os.utime(leftover, (time.time() - 60, time.time() - 60))
    mine = Path(rundir.SHARED_MEMORY_DIR) / f"sklearn_casgd_{os.getpid()}_live"
    mine.mkdir()  # a live process's run is left alone
    try:
        X, y, _ = make_glm_data("linear", 100, 4, random_state=0)
        CASGDLinearRegression(n_devices=2, device="cpu", max_iter=1, tol=None).fit(X, y)
        assert not leftover.exists()
        assert mine.exists()
    finally:
        for path in (leftover, mine):
            if path.exists():
                for child in path.iterdir():
                    child.unlink()
                path.rmdir()


def test_a_link_named_like_a_dead_run_is_not_followed(tmp_path):
    """Anyone may create names in /dev/shm: a link to this user's directory stays a link."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    target = tmp_path / "precious"
    target.mkdir()
    (target / "data.txt").write_text("keep")
    link = Path(rundir.SHARED_MEMORY_DIR) / f"sklearn_casgd_{dead.pid}_link"
    link.symlink_to(target, target_is_directory=True)
    try:
        rundir.remove_dead_runs()
        assert (target / "data.txt").read_text() == "keep"
        assert link.is_symlink()  # not ours to remove: it is no run directory
    finally:
        link.unlink()


@contextlib.contextmanager
def tmpfs(path, megabytes):
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_30_mib_shared_memory_falls_back_to_disk_with_a_warning(tmp_path, monkeypatch):
    X, y, _ = make_glm_data("linear", 200_000, 50, dtype="float32", random_state=0)  # 40 MB
    with tmpfs(tmp_path / "shm", 30) as shm:
        monkeypatch.setattr(rundir, "SHARED_MEMORY_DIR", str(shm))
        with pytest.warns(UserWarning, match="MiB free but the distributed fit needs"):
            fitted = CASGDLinearRegression(
                n_devices=2, device="cpu", precision="fp32", solver="sgd", max_iter=1, tol=None
            ).fit(X, y)
        assert fitted.fit_stats_["world_size"] == 2
        assert not list(shm.iterdir())


def test_no_room_anywhere_is_a_clear_error_not_sigbus(tmp_path, monkeypatch):
    X, y, _ = make_glm_data("linear", 200_000, 50, dtype="float32", random_state=0)  # 40 MB
    with tmpfs(tmp_path / "shm", 30) as shm, tmpfs(tmp_path / "tmp", 10) as tmp:
        monkeypatch.setattr(rundir, "SHARED_MEMORY_DIR", str(shm))
        monkeypatch.setattr("tempfile.tempdir", str(tmp))
        estimator = CASGDLinearRegression(
            n_devices=2, device="cpu", precision="fp32", max_iter=1, tol=None
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with pytest.raises(OSError, match="No room for the distributed fit's files"):
                estimator.fit(X, y)
        assert not list(tmp.iterdir()) and not list(shm.iterdir())


def test_a_shadowing_folder_in_the_cwd_is_not_imported_by_the_workers(tmp_path):
    shadow = tmp_path / "sklearn_casgd"
    shadow.mkdir()
    marker = tmp_path / "shadow_imported"
    (shadow / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise SystemExit(7)\n"
    )
    code = (
        "from sklearn_casgd import CASGDLinearRegression\n"
        "from sklearn_casgd.datasets import make_glm_data\n"
        "X, y, _ = make_glm_data('linear', 100, 4, random_state=0)\n"
        "reg = CASGDLinearRegression(n_devices=2, device='cpu', max_iter=1, tol=None).fit(X, y)\n"
        "print('world', reg.fit_stats_['world_size'])\n"
    )
    # -P: the test's own interpreter must import the real package; the
    # workers it starts get no such flag.
    completed = subprocess.run(
        [sys.executable, "-P", "-c", code],
        cwd=tmp_path,
        env=JOB_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "world 2" in completed.stdout
    assert not marker.exists()


LOW_FILE_LIMIT_POOL = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import numpy as np
from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._distributed import launch
from sklearn_casgd.datasets import make_glm_data
X, y, _ = make_glm_data("logistic", 2000, 8, random_state=0)
params = dict(n_devices=2, device="cpu", precision="fp64", batch_size=16, max_iter=2, tol=None,
              random_state=0, timeout=30)
launch.PRIVATE_NETWORK = False  # on the host's loopback, any local process can connect
first = CASGDLogisticRegression(**params).fit(X, y).coef_
print("pids", *launch.pool_for(2).pids, flush=True)
sys.stdin.readline()  # the test floods the workers' listeners meanwhile
again = CASGDLogisticRegression(**params).fit(X, y).coef_
print("same", np.array_equal(first, again), launch.pool_for(2).n_starts, flush=True)
"""


def test_more_idle_connections_than_the_usual_file_limit_do_not_kill_a_worker():
    """1,100 idle connections to each worker's gloo listener, started at a soft limit of 1024.

    With the workers on the host's loopback (where the system refuses them a
    network namespace of their own).
    """
    import resource

    connections_per_worker = 1100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 3 * connections_per_worker:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this test's own connections
    parent = subprocess.Popen(
        [sys.executable, "-c", LOW_FILE_LIMIT_POOL],
        env=JOB_ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    clients = []
    try:
        said, *pids = parent.stdout.readline().split()
        assert said == "pids" and len(pids) == 2
        listeners = listening_sockets()
        ports = {listeners[i][1] for pid in pids for i in socket_inodes(int(pid)) & set(listeners)}
        assert ports
        for port in ports:
            for _ in range(connections_per_worker):
                with contextlib.suppress(OSError):
                    clients.append(socket.create_connection(("127.0.0.1", port), timeout=1))
        assert len(clients) >= connections_per_worker
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline().split() == ["same", "True", "1"]
    finally:
        for client in clients:
            client.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        parent.kill()
        parent.wait()


@pytest.mark.distributed
def test_a_jobs_store_listens_on_master_addr_alone(tmp_path):
    """n_devices='world' from RANK/WORLD_SIZE/MASTER_ADDR: the store binds 127.0.0.1 only.

    torch's TCPStore listens on every interface whatever its host says; the
    fit hands it a socket bound to MASTER_ADDR's address.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **JOB_ENV,
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
    }
    script = Path(__file__).parent / "world_listen_script.py"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            env={**env, "RANK": str(rank)},
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    for rank in ranks:
        _, stderr = rank.communicate(timeout=120)
        assert rank.returncode == 0, stderr.decode()[-3000:]
    listening = json.loads((tmp_path / "listening.json").read_text())
    assert listening and set(listening) <= LOOPBACK
