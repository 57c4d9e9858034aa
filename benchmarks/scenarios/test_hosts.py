"""Several hosts over real links: the testbed (benchmarks/hosts.py: network namespaces, a
200 Mbit/s link each, a Ray node in each), 2 hosts of 2 workers, the GPT job's driver on
host 0. The run ends on the one-process replay with the hierarchical all-reduce and with
ZeRO-2 and ZeRO-3 sharded inside each host (``--shard-scope host``, HSDP), through a kill
and a join, through the loss of a whole host (its Ray node's processes killed by id) and
through a partition (its link cut); the bytes each host sent per step, read from the links'
counters, are ``elastic-dp plan``'s: the hierarchical all-reduce's and HSDP's, not the flat
ring's.

Needs root for the namespaces (CI runs as root); elsewhere each test skips, saying why. A
long scenario (``python3 dev.py test benchmarks/scenarios``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.hosts import LinkLog, Testbed
from elastic_dp.observe.capacity import MemoryPlan
from tests.scripts.scenario import lines, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.skipif(Testbed.unavailable() is not None,
                                                  reason=f"no testbed of hosts: {Testbed.unavailable()}")]

REPO = str(Path(__file__).resolve().parents[2])
TOL = 2e-5  # the tiny GPT job, 24 steps at micro-batches of 1: as benchmarks/scenarios/test_node_loss.py;
# worst measured 9.5e-06 (the host lost by a partition under --shard-scope host; one scenario run on 2026-12-04, python -m tests.noise): 2.1x margin
GPT_TOL = 3e-3
"""jobs.gpt, 24 steps: float32 order noise is ~3e-4 there (N=1 against N=2, docs/BENCHMARKS.md), one
skipped or repeated step moves it ~8e-2; measured here up to 6.9e-5 (one scenario run on 2026-12-04, python -m tests.noise)."""
DETECT_S = 7.0  # a host cut off is found by missed heartbeats (--heartbeat-timeout 5) in 5.9-6.1 s (docs/hosts.md)


@pytest.fixture(scope="module")
def bed():
    with Testbed(hosts=2, slots=2, rate_mbit=200) as testbed:
        yield testbed


def _start(bed: Testbed, out: Path, scenario: str, *options: str) -> subprocess.Popen:
    return bed.popen([sys.executable, "-m", "tests.scripts.hosts", str(out), scenario, *options],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _report(proc: subprocess.Popen, timeout_s: float = 150) -> dict:
    """The run's report: the last JSON line it printed (Ray's raylets may print after it)."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"the run failed ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


def _cluster_view(bed: Testbed) -> str:
    """What holds the cluster's slots: ``ray status -v`` (each node's use, the demands not
    met) and the processes in each host (``ip netns pids``): why a run did not get the
    workers it asked for."""
    views = []
    try:
        done = bed.run([str(Path(sys.executable).parent / "ray"), "status", "-v"], timeout_s=30)
        views.append(f"$ ray status -v\n{(done.stdout + done.stderr)[-4000:]}")
    except Exception as exc:  # noqa: BLE001 — a diagnosis; the failure it explains is the test's
        views.append(f"$ ray status -v: {exc}")
    for host in range(bed.hosts):
        pids = subprocess.run(["ip", "netns", "pids", bed.namespace(host)], capture_output=True, text=True,
                              check=False).stdout.split()
        names = []
        for pid in pids:
            try:
                names.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ')[:90].decode()}")
            except OSError:
                continue
        views.append(f"host {host}'s processes:\n" + "\n".join(names))
    return "\n".join(views)


def _worker_pids(events: Path) -> list[int]:
    """Every worker process a run's mesh events named."""
    return sorted({pid for e in lines(events) if e["kind"] == "mesh" for pid in e["pids"]})


def _stacks(pids: list[int]) -> str:
    """Where each live process of ``pids`` is (``py-spy dump --native``; py-spy comes with
    ``ray[default]`` for ``ray stack``): what a run that stopped going on was waiting for.
    One line a thread, innermost frame first, for the threads in elastic_dp's code and
    gloo's (the interpreter's own frames left out, each name cut to 70 characters): CI
    shows a part of a long output, and the threads that matter must fit in it."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        return f"(no stacks: {spy} is not installed)"
    dumps = []
    for pid in pids:
        if not Path(f"/proc/{pid}").exists():
            continue
        done = subprocess.run([str(spy), "dump", "--native", "--json", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=60, check=False)  # a process that ended meanwhile: its error is shown
        try:
            threads = json.loads(done.stdout)
        except json.JSONDecodeError:
            dumps.append(f"-- {pid}: {done.stdout[-300:]}{done.stderr[-300:]}")
            continue
        dumps.append(f"-- {pid}: {len(threads)} threads")
        for thread in threads:
            frames = [f for f in thread["frames"] if "libpython" not in f["filename"]]
            ours = any("elastic_dp" in f["filename"] for f in frames)
            if ours or any("gloo" in f["name"] for f in frames):
                shown = [f"{f['name'][:70]}@{Path(f['filename']).name}:{f['line']}" for f in frames[:16 if ours else 6]]
                dumps.append(f"  {thread.get('thread_name') or thread['os_thread_id']}: " + " < ".join(shown))
    return "the stacks of the driver and its live workers (threads in elastic_dp or gloo, innermost first):\n" + \
        "\n".join(dumps)


def _gpt_params() -> int:
    from jobs import gpt

    return sum(p.numel() for p in gpt.TASK.model().parameters())


def _contiguous(hosts: list[str]) -> bool:
    """Each host's ranks next to each other in the rank order."""
    return all(hosts[r] == hosts[r + 1] or hosts[r + 1] not in hosts[:r + 1] for r in range(len(hosts) - 1))


@pytest.mark.timeout(360)
def test_a_joiner_takes_its_place_beside_its_hosts_ranks_and_the_links_show_it(tmp_path):
    """Three hosts of 2 workers, jobs.gpt, a flat ring (``--all-reduce flat``): rank 2, the
    first of the middle host's ranks, is killed at step 3 and its replacement joins on that
    host (the only free slot). Beside its host's ranks (A A B B C C) the ring leaves each host
    once, and each host sends 2(N-1)/N = 1.67x the gradient's bytes a step, the plan's flat
    figure; a joiner put at the end (A A B C C B) would make the ring leave host B twice:
    B would send about twice what A and C send. Read from the links' counters between the
    steps after the join (the first at 6 workers, plus one) and the last; bounds as the
    two-host test's: the figure -2%, +0.25x. Runs first in this module, with a testbed of
    its own, before the module's two-host one is made (both at once would load 2 cores
    with 5 Ray nodes)."""
    with Testbed(hosts=3, slots=2, rate_mbit=200, name=f"edq{os.getpid() % 100000}") as bed3:
        with LinkLog(bed3) as log:
            report = _report(_start(bed3, tmp_path, "kill_middle", "all_reduce=flat", "task=gpt", "pace=0.6",
                                    "steps=24"), timeout_s=240)
        metrics = lines(tmp_path / "metrics.jsonl")
        sizes = [m["world_size"] for m in metrics]
        assert 5 in sizes and sizes[-1] == 6, sizes
        joined = next(m["step"] for m in metrics if m["world_size"] == 6 and m["step"] > 3)
        assert joined + 1 < 23, f"the joiner came at step {joined}: too late to read the links"
        gradient_bytes = 4 * _gpt_params()
        ratios = [sent / gradient_bytes for sent in log.per_step(metrics, joined + 1, 23)]  # hosts 0, 1, 2
        flat = MemoryPlan(params=_gpt_params(), workers=6, zero=0, precision="fp32",
                          hosts=3).link_bytes_per_step()["flat"] / gradient_bytes
        meshes = [e["hosts"] for e in report["events"] if e["kind"] == "mesh"]
        seen = f"after the join at step {joined}: {[round(r, 3) for r in ratios]}x the gradient's bytes per host " \
               f"per step (plan's flat ring of 6: {flat:.3f}x); rank orders {meshes}"
        print(seen)
        for ratio in ratios:
            assert 0.98 * flat < ratio < flat + 0.25, seen
        assert all(_contiguous(hosts) for hosts in meshes), seen
        first, last = meshes[0], meshes[-1]
        assert len(set(first)) == 3 and sorted(last) == sorted(first), seen  # the joiner on the killed one's host
        assert last.index(first[2]) == 2, seen  # ...in the middle, beside its host's other rank
        assert report["diff"] < GPT_TOL


@pytest.mark.parametrize("options,figure", [(("all_reduce=hierarchical",), "hierarchical"), (("all_reduce=flat",), "flat"),
                                            (("zero=2", "shard_scope=host"), "host"),
                                            (("zero=3", "shard_scope=host"), "host")],
                         ids=["hierarchical", "flat", "zero2-host", "zero3-host"])
def test_the_gpt_job_across_two_hosts_ends_on_the_replay_and_sends_the_plans_bytes_over_each_link(
        bed, tmp_path, options, figure):
    """jobs.gpt (3.3 MB of gradients), 2 hosts: the hierarchical all-reduce sends 2(H-1)/H =
    1.0x the gradient's bytes over each host's link, a flat ring of 4 ranks 2(N-1)/N = 1.5x
    (one rank of each host sends the host's share), and ZeRO-2 and ZeRO-3 sharded inside each
    host 1.0x (each chunk's gradient all-reduced with its replica; the parameter gathers stay
    inside the host), where ZeRO over all 4 ranks sends 2.0x (stage 2) and 3.0x (stage 3):
    ``elastic-dp plan``'s figures (``MemoryPlan.link_bytes_per_step``). The bytes are taken
    between the commit times of steps 4 and 20 (the links sampled every 20 ms). Bounds: no
    less than the figure -2% (the algorithm cannot send less), and no more than the figure
    + 0.25x of the gradient's bytes, half-way to the next algorithm's, for TCP/IP headers and
    the acknowledgements of what the host receives, the workers' reports to the driver and
    Ray's own traffic, which is by the second, not by the step: +4-5% alone (docs/BENCHMARKS.md)."""
    with LinkLog(bed) as log:
        report = _report(_start(bed, tmp_path, "steady", *options, "steps=24", "task=gpt"))
    per_step = log.per_step(lines(tmp_path / "metrics.jsonl"), 4, 20)
    assert report["world_sizes"] == [4] * 24 and report["diff"] < GPT_TOL
    params = _gpt_params()
    gradient_bytes = 4 * params  # fp32
    zero = next((int(o[5:]) for o in options if o.startswith("zero=")), 0)
    plan = MemoryPlan(params=params, workers=4, zero=zero, precision="fp32", hosts=2).link_bytes_per_step()
    expected = plan[figure] / gradient_bytes
    for host, sent in enumerate(per_step):
        assert 0.98 * expected < sent / gradient_bytes < expected + 0.25, (host, sent / gradient_bytes, per_step)
    print(f"{'/'.join(options)}: {[round(s / gradient_bytes, 3) for s in per_step]}x the gradient's bytes per host "
          f"per step (plan {expected:.3f}x)")


@pytest.mark.parametrize("options", [("all_reduce=hierarchical",), ("zero=2", "shard_scope=host", "task=gpt"),
                                     ("zero=3", "shard_scope=host", "task=gpt")],
                         ids=["hierarchical", "zero2-host-gpt", "zero3-host-gpt"])
def test_a_kill_and_a_join_across_hosts_end_on_the_replay(bed, tmp_path, options):
    """The tiny GPT with the hierarchical all-reduce; jobs.gpt at ZeRO-2 and ZeRO-3 under
    ``--shard-scope host``, where the kill leaves hosts of 1 and 2 workers (blocks of one:
    every worker a whole copy of the state) and the join 2 and 2 again (each host a copy):
    each re-cut from the replicas, no checkpoint (none is configured)."""
    report = _report(_start(bed, tmp_path, "kill_join", *options))
    assert report["diff"] < (GPT_TOL if "task=gpt" in options else TOL)
    sizes = report["world_sizes"]
    assert 3 in sizes and sizes[-1] == 4, sizes  # the kill, then the joiner (on the killed worker's host)
    changes = [e for e in report["events"] if e["kind"] == "membership_changed"]
    assert [c["lost"] for c in changes][:1] == [1] and any(c.get("joined") for c in changes)
    # the joiner sits beside its host's ranks: each host's ranks contiguous in every generation
    meshes = [e["hosts"] for e in report["events"] if e["kind"] == "mesh"]
    assert len(meshes) >= 3 and sorted(meshes[-1]) == sorted(bed.address_of(h) for h in (0, 0, 1, 1)), meshes
    for hosts in meshes:
        assert all(hosts[r] == hosts[r + 1] or hosts[r + 1] not in hosts[:r + 1] for r in range(len(hosts) - 1)), hosts
    assert not lines(tmp_path / "checkpoints.jsonl")


@pytest.mark.parametrize("how,zero,scope,task", [
    ("killed", 0, "all", "tiny"), ("partitioned", 0, "all", "tiny"), ("killed", 2, "all", "tiny"),
    ("killed", 2, "host", "gpt"), ("killed", 3, "host", "gpt"), ("partitioned", 3, "host", "tiny"),
    ("drained", 0, "all", "tiny"), ("drained", 2, "all", "tiny"), ("drained", 3, "host", "tiny")])
@pytest.mark.timeout(480)  # up to 120 s to start, 60 s to go on, 60 s to grow back, 150 s to end
def test_losing_a_whole_host_leaves_the_run_on_the_other_one_and_on_the_replay(bed, tmp_path, how, zero, scope, task):
    """Host 1's Ray node and workers killed by id, its link cut, or the node drained for
    preemption with Ray's own CLI (``ray drain-node``; at stage 0, at ZeRO-2, whose leavers
    hand their chunks over at the boundary, and at ZeRO-3 under ``--shard-scope host``, where
    host 0 holds a copy): the run goes on with host 0's two
    workers, from their replica at stage 0, at ZeRO-2 from the peer snapshots the snapshot
    ring put on host 0, and at ZeRO-2 and 3 under ``--shard-scope host`` from host 0's own
    copy of the state, which no peer snapshot made (no checkpoint: none is configured).
    Afterwards the host is brought back (the link healed, a new Ray node) for the next test.
    The tiny GPT, or jobs.gpt (``task``). Partitioned under ``--shard-scope host``: the host leaves (one host: its two workers
    shard the state between them, with peer snapshots) and comes back (two hosts, a copy on
    each, re-cut from the one host's chunks).

    Partitioned: the link is healed once the run went on without the host. Ray had not
    declared the node dead (its health checks allow longer than the cut lasted), so the
    run's replacements for the lost workers are placed there and join: the run grows back
    to 4 over the healed link. The lost workers themselves never rejoin (a lost member's
    state is of a step the run has moved past; the coordinator drops it)."""
    fast = tmp_path / "fast"
    pace = "pace=0.35" if how == "partitioned" else "pace=0.2"  # time for replacements to start and join
    proc = _start(bed, tmp_path, "host_lost", f"zero={zero}", pace, f"task={task}",
                  *(["all_reduce=hierarchical"] if zero == 0 else []), *([f"shard_scope={scope}"] if zero else []))
    metrics, events = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"
    reporting = False  # _report shows the run's stderr itself when it fails
    try:
        started = wait_for(metrics, lambda ms: len(ms) >= 4 and ms[-1]["world_size"] == 4, timeout_s=120)
        assert len(started) >= 4 and started[-1]["world_size"] == 4, \
            f"the run did not train 4 steps at 4 workers within 120 s: world sizes {[m['world_size'] for m in started]}"
        at = time.monotonic()
        if how == "killed":
            assert bed.kill(1), "no process ran on host 1"
        elif how == "partitioned":
            bed.cut(1)
        else:
            # the node started last on host 1: after a test that replaced it, the control store
            # may still count the earlier one of that address alive (draining that one was a
            # notice nobody heard, seen twice in 3 runs of this module)
            drained = bed.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--reason",
                               "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "test_hosts",
                               "--deadline-remaining-seconds", "60", "--node-id", bed.node_ids[1]])
            assert drained.returncode == 0, drained.stderr
        assert wait_for(metrics, lambda ms: ms[-1]["world_size"] == 2, timeout_s=60)[-1]["world_size"] == 2, \
            f"the run did not go on without host 1 within 60 s of its {how} node"
        went_on_s = time.monotonic() - at
        if how == "partitioned":
            bed.heal(1)
            assert wait_for(metrics, lambda ms: ms[-1]["world_size"] == 4, timeout_s=60)[-1]["world_size"] == 4, \
                "the run did not grow back to 4 within 60 s of the healed link"
        fast.touch()
        reporting = True
        report = _report(proc)
    finally:
        fast.touch()
        if not reporting:  # the test failed while the run trained: ended (if it still runs) before the next test's
            if proc.poll() is None:
                print(_stacks([proc.pid, *_worker_pids(events)]))
                proc.kill()
            _, err = proc.communicate()  # shown with the failure, whether the run was still going or had ended:
            print(f"the run (exit code {proc.returncode}), its stderr, the last of it:\n{err[-8000:]}\nits events:\n"
                  + ("\n".join(events.read_text().splitlines()[-20:]) if events.exists() else "none")
                  + "\nits last metrics:\n" + "\n".join(json.dumps(m) for m in lines(metrics)[-6:])
                  + "\nthe cluster after it:\n" + _cluster_view(bed))
        if how == "partitioned":
            bed.heal(1)
        bed.replace_node(1)  # a new node for the next test, once the control store counts this one dead
    assert report["diff"] < (GPT_TOL if task == "gpt" else TOL)
    # the change that let host 1 go: not the run's growth to 4 at its start (under load its
    # workers may become ready one by one, each a membership change with nothing lost or left)
    change = next((e for e in report["events"] if e["kind"] == "membership_changed" and (e["lost"] or e.get("left"))),
                  None)
    assert change is not None, f"world sizes {report['world_sizes']}, events " + "; ".join(
        f"{e['kind']} {({k: v for k, v in e.items() if k in ('cause', 'step', 'world_size', 'reason')})}"
        for e in report["events"])
    if how == "drained":  # a planned leave at a step boundary: nothing lost, nothing re-run
        assert change["lost"] == 0 and sorted(change["left_ranks"]) in ([0, 1], [2, 3]) and change["steps_rerun"] == 0
    else:  # host 1's ranks, contiguous (the hosts in the order their first worker was ready)
        assert change["lost"] == 2 and sorted(change["lost_ranks"]) in ([0, 1], [2, 3])
    if scope == "host":  # restored from host 0's live copy: at most the step in flight re-run
        assert change["steps_rerun"] <= 1, change
    print(f"host {how} at ZeRO-{zero} --shard-scope {scope}: the run went on with the other host after {went_on_s:.2f} s "
          f"(detected in {change.get('detect_s')} s)")
    if how == "partitioned":
        assert went_on_s < DETECT_S + 5, went_on_s
        assert report["world_sizes"][-1] == 4, report["world_sizes"]  # grown back over the healed link
        assert any(e.get("joined") for e in report["events"] if e["kind"] == "membership_changed")
    else:
        assert report["world_sizes"][-1] == 2
    assert not lines(tmp_path / "checkpoints.jsonl")
