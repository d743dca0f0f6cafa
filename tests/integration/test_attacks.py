"""Attacks on a real daemon by a process of another user, a hostile client and a full /dev/shm.

Each test runs one attack for real, next to a real job that must get every batch it asks for,
and checks that the daemon is still serving afterwards. Acting as another user (uid 65534,
"nobody") takes root: those tests skip without it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from dalid.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Hello,
    InputBatch,
    Ping,
    PipelineRegistered,
    Pong,
    RegisterPipeline,
    Role,
    Shutdown,
    SubmitBatch,
    Welcome,
    decode,
    encode,
    endpoint,
    transport,
)

from ..daemons import (
    ROOT,
    STARTED_PIDS,
    DaemonProcess,
    kill_leftovers,
    own_directory,
    start_daemon,
    wait_for,
    wait_until_answering,
)
from .test_client_trust import NOBODY, _interpreter_for

LOAD = [sys.executable, "-m", "tests.integration.load_job", "--workers", "0", "--window", "3"]
STEADY = [sys.executable, "-m", "tests.integration.steady_job"]
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="acts as another user: needs root")

# Runs as another user, with the standard library only (tests/integration/zmtp.py's peer).
# Its plan: connections one after the other, each with its routing id, the READY properties
# it claims, the messages it sends, and whether it reads the answers or closes at once.
_INTRUDER = """{zmtp}
import json, sys
for step in json.loads(sys.argv[2]):
    peer = None
    try:
        peer = RawPeer(
            sys.argv[1],
            timeout=step.get("timeout", 5.0),
            routing_id=bytes.fromhex(step.get("rid", "")),
            properties=tuple((k.encode(), v.encode()) for k, v in step.get("properties", [])),
        )
        try:
            for message in step["messages"]:
                peer.send([bytes.fromhex(frame) for frame in message])
        except OSError:
            pass  # refused already: what it was told may still be read
        while step.get("read"):
            print("reply", *(part.hex() for part in peer.receive()), flush=True)
    except ConnectionRefusedError as refusal:
        print("refused", refusal, flush=True)
    except TimeoutError:
        print("timeout", flush=True)
    except (ConnectionError, OSError):
        print("closed", flush=True)
    if peer is not None:
        peer.close()
print("done", flush=True)
"""


def _hex(message: Any, request_id: int) -> list[str]:
    return [bytes(frame).hex() for frame in encode(message, request_id)]


def intrude(python: str, daemon: DaemonProcess, plan: list[dict[str, Any]]) -> list[Any]:
    """Runs ``plan`` as user nobody against ``daemon``: what each step ended with, in order
    (the messages it read, decoded; "refused <reason>" for a handshake the daemon refused,
    "closed" or "timeout")."""
    code = _INTRUDER.format(zmtp=(Path(__file__).parent / "zmtp.py").read_text())
    run = subprocess.run(
        [python, "-I", "-S", "-c", code, str(daemon.socket), json.dumps(plan)],
        user=NOBODY,
        group=NOBODY,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = run.stdout.splitlines()
    assert lines and lines[-1] == "done", run.stdout + run.stderr
    return [
        decode([bytes.fromhex(part) for part in line.split()[1:]]).message
        if line.startswith("reply ")
        else line
        for line in lines[:-1]
    ]


def opened_up(directory: Path, daemon: DaemonProcess) -> None:
    """Widens the modes as an operator sharing the daemon might: others may connect."""
    directory.chmod(0o711)
    daemon.socket.chmod(0o666)


def steady_job(command: list[str]) -> subprocess.Popen[str]:
    """A real job beside the attack (``steady_job``), started by ``command``; waits until it
    runs."""
    job = subprocess.Popen(
        command,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    STARTED_PIDS.add(job.pid)
    assert job.stdout is not None
    line = job.stdout.readline()
    assert line.strip() == "running", line + job.communicate()[0]
    return job


def steady_beside(daemon: DaemonProcess) -> subprocess.Popen[str]:
    return steady_job([*STEADY, "--socket", str(daemon.socket)])


def finished(job: subprocess.Popen[str]) -> int:
    """Stops the steady job; the batches it got, every one right (none failed)."""
    out, _ = job.communicate("stop\n", timeout=90)
    assert job.returncode == 0 and out.startswith("ok "), out
    return int(out.split()[1])


def still_serving(daemon: DaemonProcess) -> None:
    assert daemon.process.poll() is None, daemon.log_text()
    daemon.status()  # answers
    log = daemon.log_text()
    assert "shutdown requested" not in log
    assert "(intruder" not in log  # no job was opened for the intruder


def refused_at_the_handshake(daemon: DaemonProcess, outcomes: list[Any]) -> None:
    """Not one message was answered (none reached the daemon); a peer that waited for the
    handshake was refused (ZeroMQ's ERROR gives the status, 400), and the log says why."""
    assert outcomes and all(isinstance(outcome, str) for outcome in outcomes), outcomes
    assert all(outcome in ("refused 400", "closed") for outcome in outcomes), outcomes
    assert "refused 400" in outcomes, outcomes
    assert f"uid {NOBODY} is refused" in daemon.log_text()


@needs_root
def test_another_user_who_sends_shutdown_and_closes_at_once_stops_nothing() -> None:
    python = _interpreter_for(NOBODY)
    if python is None:
        pytest.skip("no Python that another user may run")
    directory = own_directory()
    daemon = start_daemon(directory)
    job = steady_beside(daemon)
    try:
        opened_up(directory, daemon)
        hello = _hex(Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="intruder"), 1)
        shutdown = _hex(Shutdown(), 2)
        plan: list[dict[str, Any]] = [
            # Gone before the daemon reads the message: its credentials are the message's.
            *({"messages": [shutdown]} for _ in range(6)),
            *({"messages": [hello, shutdown]} for _ in range(3)),
            # Claiming another sender in the metadata it sends changes nothing.
            {"messages": [shutdown], "properties": [("Peer-Address", "localhost:0:0:1")]},
            # One that waits for the handshake: refused.
            {"messages": [], "read": True},
        ]
        refused_at_the_handshake(daemon, intrude(python, daemon, plan))
        still_serving(daemon)
        assert finished(job) > 1
        assert not daemon.status().jobs
    finally:
        kill_leftovers([job])
        assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


@needs_root
def test_another_user_reusing_a_clients_routing_id_gets_nothing() -> None:
    # A routing id is no secret: a client may choose one (zmq.ROUTING_ID), and an attacker
    # may guess one.
    python = _interpreter_for(NOBODY)
    if python is None:
        pytest.skip("no Python that another user may run")
    directory = own_directory()
    daemon = start_daemon(directory)
    job = steady_beside(daemon)
    context: zmq.Context[Any] = zmq.Context()
    victim_id = b"victim-routing-id"
    victim = context.socket(zmq.DEALER)
    try:
        opened_up(directory, daemon)
        victim.setsockopt(zmq.ROUTING_ID, victim_id)
        victim.connect(endpoint(daemon.socket))
        transport.send(victim, Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="victim"), 1)
        assert victim.poll(10_000) and isinstance(transport.recv(victim).message, Welcome)
        hello = _hex(Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="intruder"), 1)
        shutdown = _hex(Shutdown(), 2)
        # Under the victim's id while it is connected, sending more than the daemon reads of a
        # connection at once, then reading or closing: that once aborted the daemon in libzmq
        # (Note [A routing id claimed twice] in server/intake/reception.py).
        step: dict[str, Any] = {"rid": victim_id.hex(), "messages": [shutdown, hello, shutdown]}
        plan: list[dict[str, Any]] = [
            {**step, "read": True},
            step,
            step,
            {"rid": victim_id.hex(), "messages": [], "read": True},
        ]
        refused_at_the_handshake(daemon, intrude(python, daemon, plan))
        still_serving(daemon)
        assert finished(job) > 1
        # The victim was not touched: its job is there and its connection answers.
        assert [job.name for job in daemon.status().jobs] == ["victim"]
        transport.send(victim, Ping(), 2)
        assert victim.poll(10_000) and isinstance(transport.recv(victim).message, Pong)
    finally:
        victim.close(linger=0)
        context.term()
        kill_leftovers([job])
        assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


# --- a full /dev/shm -------------------------------------------------------------------------

_TOOLS = ("unshare", "nsenter", "setpriv", "mount", "dd")
needs_namespaces = pytest.mark.skipif(
    os.getuid() != 0 or not all(shutil.which(tool) for tool in _TOOLS),
    reason="a private /dev/shm takes root and util-linux (unshare, nsenter, setpriv)",
)


def start_daemon_with_small_shm(directory: Path, megabytes: int) -> DaemonProcess:
    """A daemon in a mount namespace of its own whose /dev/shm is a tmpfs of ``megabytes``
    that every user may write to, as the host's."""
    socket = directory / "d.sock"
    log = directory / "d.log"
    script = (
        f"mount -t tmpfs -o size={megabytes}m,mode=1777 tmpfs /dev/shm && exec "
        f'"$@" serve --socket {socket} --no-supervisor'
    )
    command = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, sys.executable, "-m", "dalid.server"], stdout=out, stderr=subprocess.STDOUT
        )
    STARTED_PIDS.add(process.pid)
    daemon = DaemonProcess(socket, process, log)
    try:
        wait_until_answering(socket, process)
    except BaseException:
        daemon.stop()
        raise
    return daemon


AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def in_its_namespace(daemon: DaemonProcess, *command: str) -> list[str]:
    return ["nsenter", "-t", str(daemon.pid), "-m", f"--wd={ROOT}", "--", *command]


@needs_namespaces
def test_a_full_dev_shm_fails_the_batches_that_need_it_and_nothing_else() -> None:
    directory = own_directory()
    daemon = start_daemon_with_small_shm(directory, 24)
    jobs: list[subprocess.Popen[str]] = []
    socket = ["--socket", str(daemon.socket)]
    try:
        # A trainer maps its slabs in the daemon's /dev/shm: the jobs run in its namespace.
        steady = steady_job(in_its_namespace(daemon, *STEADY, *socket))
        jobs.append(steady)
        # Its memory is made before the attack: a trainer that holds a few batches at a time
        # needs its slabs within its first batches, and reuses them from then on.
        wait_for(
            lambda: any(job.batches_done >= 20 for job in daemon.status().jobs),
            60,
            "the steady job's first batches",
        )
        # Another user fills /dev/shm, as dd did when it killed the daemon with SIGBUS.
        fill = subprocess.run(
            in_its_namespace(daemon, *AS_NOBODY, "dd", "if=/dev/zero", "of=/dev/shm/filler"),
            capture_output=True,
            text=True,
            check=False,
        )
        assert "No space left on device" in fill.stderr, fill.stderr
        # A new job needs slabs: its batch fails, saying why, and is answered.
        late = subprocess.run(
            in_its_namespace(daemon, *LOAD, *socket, "--name", "late", "--batches", "3"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        out = late.stdout + late.stderr
        assert late.returncode != 0 and "/dev/shm is full" in out, out + daemon.log_text()
        before = daemon.status().jobs
        assert finished(steady) > 20
        assert [job.batches_failed for job in before if job.name == "steady"] == [0]
        # Space given back: a job runs again.
        subprocess.run(in_its_namespace(daemon, "rm", "/dev/shm/filler"), check=True)
        again = subprocess.run(
            in_its_namespace(daemon, *LOAD, *socket, "--name", "again", "--batches", "3"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert again.returncode == 0 and "ok 3" in again.stdout, again.stdout + again.stderr
        assert daemon.process.poll() is None, daemon.log_text()
    finally:
        kill_leftovers(jobs)
        assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


# --- hostile graphs --------------------------------------------------------------------------


def _register(sock: zmq.Socket[Any], serialized: bytes, request_id: int) -> Any:
    transport.send(
        sock, RegisterPipeline(memoryview(serialized), ("data",), 2, 2, 1, 1), request_id
    )
    assert sock.poll(60_000), "no answer to a registration"
    return transport.recv(sock).message


def test_hostile_graphs_are_refused_before_dali_and_the_daemon_serves_on() -> None:
    from nvidia.dali import fn

    from ..graphs import hostile_graph, int_argument, renamed
    from ..unit.test_operators import small

    directory = own_directory()
    daemon = start_daemon(directory)
    job = steady_beside(daemon)
    context: zmq.Context[Any] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(daemon.socket), bind=False)
    try:
        transport.send(sock, Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="grapher"), 1)
        assert sock.poll(10_000) and isinstance(transport.recv(sock).message, Welcome)
        base = small().serialize()
        # The reproduction: a Python function "at" 0x4141414141 segfaulted the daemon.
        crafted = renamed(
            base, "Cast", "DLTensorPythonFunctionImpl", int_argument("function_id", 0x4141414141)
        )
        refusal = _register(sock, crafted, 2)
        assert isinstance(refusal, Error) and refusal.code is ErrorCode.INVALID_PIPELINE
        assert "'DLTensorPythonFunctionImpl' is refused" in refusal.message
        # fn.dump_image serializes fine, and would write files where the daemon runs.
        dumping = small()
        with dumping:
            data = fn.external_source(name="data", layout="HWC")
            dumping.set_outputs(data, fn.dump_image(data))
        refusal = _register(sock, dumping.serialize(), 3)
        assert (
            isinstance(refusal, Error) and "'DumpImage' is refused: writes files" in refusal.message
        )
        # A smaller fuzz than the checker's own (tests/unit/test_operators.py), to the end:
        # what passes the checker is built by DALI, or refused by it; every one is answered.
        rng = random.Random(7)
        answers = {"registered": 0, "refused": 0}
        for request_id in range(10, 50):
            reply = _register(sock, hostile_graph(rng, base), request_id)
            assert isinstance(reply, PipelineRegistered | Error), reply
            answers["registered" if isinstance(reply, PipelineRegistered) else "refused"] += 1
        assert answers["refused"] >= 10, answers
        assert daemon.process.poll() is None, daemon.log_text()
        assert finished(job) > 1
        daemon.status()
    finally:
        sock.close(linger=0)
        context.term()
        kill_leftovers([job])
        assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


def test_registrations_cannot_take_the_daemons_threads_pipelines_or_memory() -> None:
    from nvidia.dali import fn
    from nvidia.dali.pipeline import pipeline_def as untyped_pipeline_def

    from ..unit.test_operators import small

    directory = own_directory()
    daemon = start_daemon(directory, "--max-daemon-pipelines", "4")
    job = steady_beside(daemon)  # one pipeline
    context: zmq.Context[Any] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(daemon.socket), bind=False)
    cores = len(os.sched_getaffinity(daemon.pid))
    try:
        transport.send(sock, Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="greedy"), 1)
        assert sock.poll(10_000) and isinstance(transport.recv(sock).message, Welcome)
        serialized = memoryview(small().serialize())
        # The reproduction: 1,024 threads, deterministic (a pipeline of its own each time),
        # took the daemon from 4 threads to 1,034, then 2,064, then past its pids limit.
        for request_id in (2, 3, 4):
            greedy = RegisterPipeline(serialized, ("data",), 2, 2, 1024, 1, deterministic=True)
            transport.send(sock, greedy, request_id)
            assert sock.poll(60_000)
            assert isinstance(transport.recv(sock).message, PipelineRegistered)
        threads = len(os.listdir(f"/proc/{daemon.pid}/task"))
        assert threads < 100, threads
        greedy_pipelines = [p for p in daemon.status().pipelines if p.threads_asked]
        assert len(greedy_pipelines) == 3
        assert all(p.threads_asked == 1024 and p.threads <= cores for p in greedy_pipelines)
        assert daemon.log_text().count("asked for 1024 DALI threads and gets") == 3
        # The daemon runs 4 pipelines now, its limit: a fifth is refused, saying so.
        transport.send(sock, greedy, 5)
        assert sock.poll(60_000)
        refusal = transport.recv(sock).message
        assert isinstance(refusal, Error) and refusal.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "--max-daemon-pipelines 4" in refusal.message

        # The reproduction: a 1x1x3 image resized to 40,000x40,000 (the daemon was OOM-killed).
        @untyped_pipeline_def(batch_size=2, num_threads=1, device_id=None)  # type: ignore[call-overload,untyped-decorator]
        def huge() -> Any:
            return fn.resize(fn.external_source(name="data", layout="HWC"), size=(40000, 40000))

        transport.send(
            sock, RegisterPipeline(memoryview(huge().serialize()), ("data",), 1, 2, 1, 1), 6
        )
        assert sock.poll(60_000)
        refusal = transport.recv(sock).message
        assert isinstance(refusal, Error) and refusal.code is ErrorCode.INVALID_PIPELINE
        assert "Resize makes samples of 1600000000 elements" in refusal.message
        assert daemon.process.poll() is None, daemon.log_text()
        assert finished(job) > 1
    finally:
        sock.close(linger=0)
        context.term()
        kill_leftovers([job])
        assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


def test_sizes_a_batch_sends_beyond_its_jobs_limits_are_refused_before_dali_allocates() -> None:
    """The reproduction: ``fn.resize`` with its size from an input, sent 40,000x40,000,
    OOM-killed the daemon. The batch is refused by its sizes, saying why, on the daemon's pixel
    limit and on the job's own output memory; the job's next batch and a job beside it run."""
    import torch
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import pipeline_def as untyped_pipeline_def

    import dalid.client as dalid

    @untyped_pipeline_def(batch_size=2, num_threads=1, device_id=None)  # type: ignore[call-overload,untyped-decorator]
    def resized() -> Any:
        images = fn.external_source(
            name="images", dtype=types.DALIDataType.UINT8, ndim=3, layout="HWC"
        )
        sizes = fn.external_source(name="sizes", dtype=types.DALIDataType.FLOAT, ndim=1)
        return fn.resize(images, size=sizes)

    directory = own_directory()
    daemon = start_daemon(directory)
    pid = daemon.pid
    job = steady_beside(daemon)
    image = np.zeros((1, 1, 3), np.uint8)

    def batch(proxy: Any, side: int) -> Any:
        sizes = np.array([side, side], np.float32)
        return torch.utils.data.default_collate([proxy(images=image, sizes=sizes) for _ in "ab"])

    try:
        with dalid.connect(
            socket=daemon.socket, autostart=False, memory_bytes=64 << 20, name="resizer"
        ) as session:
            proxy = session.proxy(resized())
            with pytest.raises(dalid.BatchError) as caught:
                session.produce_data(batch(proxy, 40000))
            message = str(caught.value)
            assert "Resize would make a sample of 1600000000 elements or more" in message
            assert "this batch's size='sizes', over this daemon's limit" in message
            # Under the pixel limit a sample, over the job's 64 MiB of output memory a batch.
            with pytest.raises(dalid.BatchError) as caught:
                session.produce_data(batch(proxy, 8000))
            message = str(caught.value)
            assert "at least 122 MiB of outputs for this batch" in message
            assert "more than the job's 64 MiB of output memory" in message
            assert session.produce_data(batch(proxy, 4)).shape == (2, 4, 4, 3)
        assert daemon.pid == pid
        still_serving(daemon)
        assert finished(job) > 1
    finally:
        kill_leftovers([job])
        assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


# --- a graph that crashes DALI ---------------------------------------------------------------


def test_a_graph_running_when_the_daemon_died_is_refused_to_its_trainer_after() -> None:
    from ..crashing_daemon import CRASHER
    from ..unit.test_operators import small
    from .helpers import two_output_pipeline

    directory = own_directory()
    serialized = memoryview(small().serialize())
    crashing = start_daemon(directory, module="tests.crashing_daemon")
    context: zmq.Context[Any] = zmq.Context()
    daemon: DaemonProcess | None = None
    socks: list[zmq.Socket[Any]] = []

    def trainer() -> tuple[zmq.Socket[Any], Welcome]:
        sock = transport.make_socket(context, zmq.DEALER, endpoint(crashing.socket), bind=False)
        socks.append(sock)
        transport.send(sock, Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="victim"), 1)
        assert sock.poll(10_000)
        welcome = transport.recv(sock).message
        assert isinstance(welcome, Welcome)
        return sock, welcome

    def register(sock: zmq.Socket[Any], name: str) -> Any:
        transport.send(sock, RegisterPipeline(serialized, ("data",), 2, 2, 1, 1, name=name), 2)
        assert sock.poll(60_000)
        return transport.recv(sock).message

    try:
        sock, welcome = trainer()
        registered = register(sock, CRASHER)
        assert isinstance(registered, PipelineRegistered), registered
        samples = [np.zeros((2, 2, 3), np.uint8) for _ in range(2)]
        batch = SubmitBatch(
            registered.pipeline_id,
            (InputBatch.of("data", samples),),
            welcome.batch_id_base + 1,
        )
        transport.send(sock, batch, 3)
        assert crashing.process.wait(30) == -signal.SIGSEGV
        sock.close(linger=0)
        # The next daemon on the socket (the supervisor's restart, here by hand).
        daemon = start_daemon(directory)
        log = daemon.log_text()
        assert "the previous daemon died of a fatal signal" in log
        assert "Segmentation fault" in log
        assert "while pipeline 'crasher' ran for trainer pid" in log
        sock, _ = trainer()
        refusal = register(sock, CRASHER)
        assert isinstance(refusal, Error) and refusal.code is ErrorCode.INVALID_PIPELINE
        assert f"running for this trainer (pid {os.getpid()}) when the daemon died" in (
            refusal.message
        )
        # Another graph is served to it.
        graph = memoryview(two_output_pipeline().serialize())
        transport.send(sock, RegisterPipeline(graph, ("data",), 2, 8, 1, 1), 4)
        assert sock.poll(60_000)
        assert isinstance(transport.recv(sock).message, PipelineRegistered)
    finally:
        for sock in socks:
            sock.close(linger=0)
        context.term()
        crashing.stop()
        if daemon is not None:
            assert daemon.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


def test_a_crash_beside_another_trainers_runs_blames_no_one_until_a_solo_run_crashes() -> None:
    """The reproduction: a job running beside the graph that crashed the daemon was refused its
    graph by the next daemon, and died with its ``reconnect=True``. Now both are on probation:
    the victim is served throughout, and the crasher, crashing again with its run alone in DALI,
    is refused."""
    from ..crashing_daemon import BESIDE, CRASHER
    from ..unit.test_operators import small

    directory = own_directory()
    serialized = memoryview(small().serialize())
    crashing = start_daemon(directory, module="tests.crashing_daemon")
    daemons = [crashing]
    victim = steady_job([*STEADY, "--socket", str(crashing.socket), "--reconnect"])
    context: zmq.Context[Any] = zmq.Context()
    socks: list[zmq.Socket[Any]] = []

    def crash(daemon: DaemonProcess, name: str) -> None:
        """Registers the crashing graph as ``name`` from this process and runs it: the daemon
        dies of it."""
        sock = transport.make_socket(context, zmq.DEALER, endpoint(daemon.socket), bind=False)
        socks.append(sock)
        transport.send(sock, Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="attacker"), 1)
        assert sock.poll(10_000)
        welcome = transport.recv(sock).message
        assert isinstance(welcome, Welcome)
        transport.send(sock, RegisterPipeline(serialized, ("data",), 2, 2, 1, 1, name=name), 2)
        assert sock.poll(60_000)
        registered = transport.recv(sock).message
        assert isinstance(registered, PipelineRegistered), registered
        samples = [np.zeros((2, 2, 3), np.uint8) for _ in range(2)]
        inputs = (InputBatch.of("data", samples),)
        batch = SubmitBatch(registered.pipeline_id, inputs, welcome.batch_id_base + 1)
        transport.send(sock, batch, 3)
        assert daemon.process.wait(60) == -signal.SIGSEGV, daemon.log_text()

    try:
        # The victim's runs are in DALI beside the crasher's when the daemon dies.
        crash(crashing, BESIDE)
        crashing = start_daemon(directory, module="tests.crashing_daemon")
        daemons.append(crashing)
        log = crashing.log_text()
        assert f"while pipeline {BESIDE!r} ran for trainer pid {os.getpid()}: runs of" in log
        assert f"ran for trainer pid {victim.pid}: runs of other trainers" in log
        # The victim reconnects and is served, on a pipeline of its own, its runs alone.
        wait_for(
            lambda: any(
                p.private_reason.startswith("on probation") and p.runs
                for p in crashing.status().pipelines
            ),
            60,
            "the victim's runs on probation",
        )
        # The crasher, on probation too, crashes again: alone in DALI, it is convicted.
        crash(crashing, CRASHER)
        daemon = start_daemon(directory)
        daemons.append(daemon)
        log = daemon.log_text()
        assert f"while pipeline {CRASHER!r} ran for trainer pid {os.getpid()}: that graph" in log
        assert f"trainer pid {victim.pid}: that graph is refused" not in log
        sock = transport.make_socket(context, zmq.DEALER, endpoint(daemon.socket), bind=False)
        socks.append(sock)
        transport.send(sock, Hello(PROTOCOL_VERSION, 1, Role.TRAINER, name="attacker"), 1)
        assert sock.poll(10_000) and isinstance(transport.recv(sock).message, Welcome)
        transport.send(sock, RegisterPipeline(serialized, ("data",), 2, 2, 1, 1), 2)
        assert sock.poll(60_000)
        refusal = transport.recv(sock).message
        assert isinstance(refusal, Error) and refusal.code is ErrorCode.INVALID_PIPELINE
        assert f"running for this trainer (pid {os.getpid()}) when the daemon died" in (
            refusal.message
        )
        # The victim got every batch it asked for, right, across both crashes (its log says
        # so, each time its daemon went).
        out, _ = victim.communicate("stop\n", timeout=90)
        *said, last = out.strip().splitlines()
        assert victim.returncode == 0 and last.startswith("ok ") and int(last.split()[1]) > 1, out
        assert all("reconnecting" in line or "reconnected" in line for line in said), out
        still_serving(daemon)
    finally:
        for sock in socks:
            sock.close(linger=0)
        context.term()
        kill_leftovers([victim])
        for each in daemons[:-1]:
            each.stop()
        assert daemons[-1].stop() == 0 or len(daemons) < 3
        shutil.rmtree(directory, ignore_errors=True)
