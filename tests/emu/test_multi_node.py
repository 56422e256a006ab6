"""Several machines for real, on the emulator: one torchrun per emulated host, ``--nnodes 4``,
c10d rendezvous at ``h0:29400`` (docs/multi_node.md, #39 item 7) (root).

    sudo .venv/bin/python -m pytest tests/emu/test_multi_node.py -q

Each host runs what a real machine of a cluster runs (``srun`` or a Kubeflow PyTorchJob
starts the same command on every node: examples/slurm/, examples/kubernetes/): a torchrun
agent that finds the others through the c10d rendezvous on host 0, which works only because
every host has a name of its own that all the others resolve (``mlfabric launch`` gives them).
Small jobs (a 2-layer MLP, 2 epochs; 40 PS steps): the machine here has 2 cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.emu.conftest import needs_root, our_leftovers
from tests.unit.test_multi_node_examples import SBATCH, manifest_command, write_slurm_stand_ins

ROOT = Path(__file__).resolve().parents[2]
HOSTS = 4


def _torchrun_on_every_host(script: str, *args: str, rdzv_id: str) -> str:
    """``mlfabric launch --hosts 4 -- torchrun --nnodes 4 ...``: the launcher's output."""
    return _on_every_host(["torchrun", "--nnodes", str(HOSTS), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", "h0:29400", "--rdzv-id", rdzv_id, "--max-restarts", "0",
                           str(ROOT / "examples" / script), *args])


def _on_every_host(command: list[str], *, launch_options: tuple[str, ...] = (), env: dict[str, str] | None = None) -> str:
    """``mlfabric launch --hosts 4 -- COMMAND`` from the repository root: the launcher's output."""
    cli = Path(sys.executable).with_name("mlfabric")
    argv = [str(cli), "launch", "--hosts", str(HOSTS), "--rate", "1gbit", "--timeout", "300s", *launch_options, "--",
            *command]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=360, cwd=ROOT, env={**os.environ, **(env or {})})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    # One agent per host: all four took part, each under its own name.
    prefix = re.search(r"cluster (mf[0-9a-f]{4}):", out.stderr)[1]
    assert f"hosts are named {prefix}-h0 .. {prefix}-h{HOSTS - 1} (aliases h0 .. h{HOSTS - 1})" in out.stderr, text
    assert "hostname of the client socket cannot be retrieved" not in text
    assert not [name for name in our_leftovers() if name.startswith(prefix)]  # torn down
    return text


def _check_ddp(text: str) -> None:
    match = re.search(r"backend=mlfabric ddp (\d+) ranks: loss per epoch ([\d.]+), ([\d.]+); parameter fingerprint "
                      r"([\d.]+); replicas identical: (\w+)", text)
    assert match, text[-4000:]
    assert match[1] == str(HOSTS)  # one world over the four torchruns
    assert float(match[3]) < 0.75 * float(match[2]), match[0]  # it learns (0.92 -> 0.47 measured)
    assert match[5] == "True", match[0]  # every rank holds exactly the same parameters


def _check_ps(text: str) -> None:
    errors = [float(e) for e in re.findall(r"\(worker \d\): last loss [\d.]+, \|w - w_true\| ([\d.]+)", text)]
    assert len(errors) == HOSTS - 1 and max(errors) < 0.2, text[-4000:]  # every worker learned w_true
    match = re.search(r"\(server 0\): (\d+) updates applied, (\d+) dropped", text)
    assert match, text[-4000:]
    assert int(match[1]) + int(match[2]) == (HOSTS - 1) * 40  # every worker's every push reached the server


@needs_root
def test_ddp_on_the_mlfabric_backend_over_four_machines(no_leaks):
    """The command docs/multi_node.md gives: one torchrun per host, c10d rendezvous at h0."""
    _check_ddp(_torchrun_on_every_host("torch_backend.py", "--backend", "mlfabric", "--epochs", "2", rdzv_id="ddp"))


@needs_root
def test_parameter_server_through_the_slurm_recipe(no_leaks, tmp_path):
    """examples/slurm/multi_node.sbatch on every host, as `sbatch` runs it on every node's
    first task, with srun and scontrol stand-ins (srun: run the command on this host)."""
    bin_dir = write_slurm_stand_ins(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "MLFABRIC_VENV": str(Path(sys.executable).parents[1]),
           "SLURM_JOB_NODELIST": ",".join(f"h{h}" for h in range(HOSTS)), "SLURM_JOB_NUM_NODES": str(HOSTS),
           "SLURM_JOB_ID": "39"}
    _check_ps(_on_every_host(["bash", str(SBATCH), "examples/ps_train.py", "--consistency", "ssp:2", "--steps", "40"],
                             env=env))


@needs_root
def test_ddp_through_the_kubernetes_manifests_command(no_leaks):
    """The command of examples/kubernetes/pytorchjob.yaml on every host, with the variables the
    training operator sets (MASTER_ADDR: host 0, the launcher's; MASTER_PORT its port)."""
    job = "examples/torch_backend.py --backend mlfabric"
    command = manifest_command()
    assert command.endswith(job), command
    _check_ddp(_on_every_host(["sh", "-c", f"{command} --epochs 2"],  # 2 epochs: short, on 2 cores
                              launch_options=("--master-port", "23456"),
                              env={"PET_NNODES": str(HOSTS), "PET_NPROC_PER_NODE": "1"}))
